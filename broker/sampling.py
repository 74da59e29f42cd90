"""Learner sampling: uniform over the newest ``window`` items of a store, stale items skipped.

An item is stale when its ``policy_version`` is more than ``max_staleness`` behind the current
policy version: it stays stored (metrics, analysis) but is not served for training. Expert
demonstrations and episodes do not depend on the policy and are never stale.

With a seed, the same store contents give the same batch: indices come from a seeded, lazily
evaluated Fisher-Yates permutation of the window, so drawing ``n`` items costs O(n) rather than
O(window) even when some of them turn out stale and more are drawn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from broker.ingest import record_from_store
from broker.store import ReplayStore

STALENESS_STORES = ("transitions", "reflections")


@dataclass(slots=True)
class SampleResult:
    items: list[dict[str, Any]]
    stale_skipped: int
    available: int


def lazy_permutation(rng: random.Random, lo: int, hi: int) -> Iterator[int]:
    """The integers of [lo, hi) in a uniformly random order, generated one at a time."""
    n = hi - lo
    swapped: dict[int, int] = {}
    for i in range(n):
        j = rng.randrange(i, n)
        vi, vj = swapped.get(i, i), swapped.get(j, j)
        swapped[j] = vi
        swapped.pop(i, None)
        yield lo + vj


def is_stale(item: dict[str, Any], current_policy: int, max_staleness: int) -> bool:
    version = item.get("policy_version")
    return isinstance(version, int) and current_policy - version > max_staleness


def sample(
    store: ReplayStore,
    name: str,
    n: int,
    *,
    window: int,
    current_policy: int,
    max_staleness: int,
    seed: int | None = None,
    chunk: int = 64,
) -> SampleResult:
    """Up to ``n`` distinct, non-stale items from the newest ``window`` items of ``name``."""
    tail, head = store.bounds(name)
    lo = max(tail, head - window)
    available = head - lo
    rng = random.Random(seed)
    check = name in STALENESS_STORES
    perm = lazy_permutation(rng, lo, head)
    items: list[dict[str, Any]] = []
    stale = 0
    while len(items) < n:
        want = max(n - len(items), min(chunk, n))
        indices = [i for _, i in zip(range(want), perm)]
        if not indices:
            break
        for value in store.get_many(name, indices):
            if value is None:  # evicted between bounds() and here cannot happen (one thread); be safe
                continue
            rec = record_from_store(name, value)
            if check and is_stale(rec, current_policy, max_staleness):
                stale += 1
                continue
            if len(items) < n:
                items.append(rec)
    return SampleResult(items, stale, available)
