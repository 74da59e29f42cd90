"""Learner sampling: uniform over the newest ``window`` items of a store, stale items skipped.

An item is stale when its ``policy_version`` is more than ``max_staleness`` behind the current
policy version: it stays stored (metrics, analysis) but is not served for training. Expert
demonstrations, episodes and suffix-labelled reflection samples (labelled by outcome) are never stale.

With a seed, the same store contents give the same batch: indices come from a seeded, lazily
evaluated Fisher-Yates permutation of the window, so drawing ``n`` items costs O(n) rather than
O(window) even when some of them turn out stale and more are drawn.

A ``phases`` filter serves only items of those phases (co-evolution trains the world model on
on-policy transitions, docs/design.md section 6). Non-matching items are skipped and counted like
stale ones; the draws stay O(n / share of matching items), and the scan ends at the window, so a
filter nothing matches returns an empty batch instead of looping.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from broker.ingest import record_from_store
from broker.store import ReplayStore
from comap_async.wire.messages import REFLECT_INIT, WARMUP
from comap_async.wire.protocol import PHASES
from comap_async.wire.records import is_suffix_label

STALENESS_STORES = ("transitions", "reflections")
# The phase of a record that has no ``phase`` field: suffix-labelled reflection samples
# (``source: suffix``) are written during reflection-mode initialisation; demonstrations are the
# warm-up's expert steps.
DEFAULT_PHASE = {"reflections": REFLECT_INIT, "demos": WARMUP}


@dataclass(slots=True)
class SampleResult:
    items: list[dict[str, Any]]
    stale_skipped: int
    available: int
    phase_skipped: int = 0  # drawn, but of a phase the request did not ask for


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
    """Too far behind the current policy to train on. Suffix-labelled reflection samples never are:
    their label comes from the rollouts' outcome, not from the policy version that drafted."""
    if is_suffix_label(item):
        return False
    version = item.get("policy_version")
    return isinstance(version, int) and current_policy - version > max_staleness


def record_phase(name: str, rec: dict[str, Any]) -> str | None:
    """The phase a stored record was produced in (None when neither it nor its store says)."""
    return rec.get("phase") or DEFAULT_PHASE.get(name)


def checked_phases(phases: Any) -> frozenset[str] | None:
    """The ``phases`` filter of a sample request as a set (None: no filter); ValueError if unknown."""
    if phases is None:
        return None
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise ValueError(f"sample: phases must be a non-empty subset of {list(PHASES)}, got {phases!r}")
    return frozenset(phases)


def sample(
    store: ReplayStore,
    name: str,
    n: int,
    *,
    window: int,
    current_policy: int,
    max_staleness: int,
    seed: int | None = None,
    phases: Any = None,
    chunk: int = 64,
) -> SampleResult:
    """Up to ``n`` distinct, non-stale items from the newest ``window`` items of ``name``,
    only of ``phases`` when given."""
    tail, head = store.bounds(name)
    lo = max(tail, head - window)
    available = head - lo
    rng = random.Random(seed)
    check = name in STALENESS_STORES
    wanted = checked_phases(phases)
    perm = lazy_permutation(rng, lo, head)
    items: list[dict[str, Any]] = []
    stale = off_phase = 0
    while len(items) < n:
        # the draw grows with the skip rate seen so far: few LMDB reads when matches are rare
        drawn = len(items) + stale + off_phase
        rate = (len(items) + 1) / (drawn + 1)
        want = max(n - len(items), min(chunk, n), min(4096, int((n - len(items)) / rate)))
        indices = [i for _, i in zip(range(want), perm)]
        if not indices:
            break
        for value in store.get_many(name, indices):
            if value is None:  # evicted between bounds() and here cannot happen (one thread); be safe
                continue
            rec = record_from_store(name, value)
            if wanted is not None and record_phase(name, rec) not in wanted:
                off_phase += 1
                continue
            if check and is_stale(rec, current_policy, max_staleness):
                stale += 1
                continue
            if len(items) < n:
                items.append(rec)
    return SampleResult(items, stale, available, off_phase)
