"""Sampling: newest window, staleness skipping (counted), reproducibility with a seed."""

from __future__ import annotations

import random

import msgpack

from broker.replay_sampling import lazy_permutation, sample
from broker.store import ReplayStore, WriteItem

CAPS = {"transitions": 1000, "reflections": 1000, "demos": 1000, "episodes": 10}


def fill(st: ReplayStore, store: str, versions: list[int]) -> None:
    st.write(
        [
            WriteItem(f"{store}:{i}".encode(), [(store, msgpack.packb({"id": i, "policy_version": v}))])
            for i, v in enumerate(versions)
        ]
    )


def test_lazy_permutation_is_a_permutation_and_seeded():
    perm = list(lazy_permutation(random.Random(3), 10, 60))
    assert sorted(perm) == list(range(10, 60))
    assert perm == list(lazy_permutation(random.Random(3), 10, 60))
    assert perm != list(lazy_permutation(random.Random(4), 10, 60))


def test_lazy_permutation_is_uniform():
    counts = [0] * 5
    rng = random.Random(0)
    for _ in range(20_000):
        counts[next(lazy_permutation(rng, 0, 5))] += 1
    assert all(3_600 < c < 4_400 for c in counts), counts


def test_only_the_newest_window_is_sampled(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    fill(st, "reflections", [0] * 100)
    res = sample(st, "reflections", 20, window=20, current_policy=0, max_staleness=4, seed=1)
    assert sorted(r["id"] for r in res.items) == list(range(80, 100)) and res.available == 20
    res = sample(st, "reflections", 50, window=10, current_policy=0, max_staleness=4, seed=1)
    assert len(res.items) == 10  # never more than the window, no repeats


def test_stale_items_are_skipped_and_counted(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    # versions 0..9, ten items each; current policy 9, max_staleness 2 -> versions 7, 8, 9 are fresh
    fill(st, "transitions", [i // 10 for i in range(100)])
    res = sample(st, "transitions", 30, window=100, current_policy=9, max_staleness=2, seed=5)
    assert len(res.items) == 30 and all(r["policy_version"] >= 7 for r in res.items)
    assert res.stale_skipped == 70 and res.available == 100
    few = sample(st, "transitions", 5, window=100, current_policy=9, max_staleness=2, seed=5)
    assert len(few.items) == 5 and all(r["policy_version"] >= 7 for r in few.items)
    assert 0 <= few.stale_skipped <= 70


def test_demos_are_never_stale(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    fill(st, "demos", [0] * 10)
    res = sample(st, "demos", 10, window=100, current_policy=50, max_staleness=0, seed=1)
    assert len(res.items) == 10 and res.stale_skipped == 0


def test_same_seed_same_batch_different_seed_different_batch(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    fill(st, "reflections", [3] * 500)
    a = sample(st, "reflections", 16, window=400, current_policy=3, max_staleness=1, seed=42)
    b = sample(st, "reflections", 16, window=400, current_policy=3, max_staleness=1, seed=42)
    c = sample(st, "reflections", 16, window=400, current_policy=3, max_staleness=1, seed=43)
    assert [r["id"] for r in a.items] == [r["id"] for r in b.items] != [r["id"] for r in c.items]
    assert len({r["id"] for r in a.items}) == 16


def test_empty_store_gives_empty_batch(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    res = sample(st, "demos", 8, window=100, current_policy=0, max_staleness=1, seed=0)
    assert res.items == [] and res.available == 0 and res.stale_skipped == 0
