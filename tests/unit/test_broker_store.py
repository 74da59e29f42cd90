"""ReplayStore on real LMDB files: rings, eviction, dedup, persistence, map growth, refusal."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgpack
import pytest

from broker.store import DUPLICATE, STORED, ReplayStore, StoreRefused, WriteItem

CAPS = {"transitions": 5, "reflections": 5, "demos": 3, "episodes": 2}


def item(i: int, size: int = 10, stores: tuple[str, ...] = ("transitions",)) -> WriteItem:
    rec = msgpack.packb({"id": f"t{i}", "pad": "x" * size})
    return WriteItem(f"t:{i}".encode(), [(s, rec) for s in stores], {"stored_transitions": 1})


def ids(store: ReplayStore, name: str) -> list[str]:
    return [msgpack.unpackb(v)["id"] for v in store.iter_store(name)]


def test_ring_evicts_oldest_first_and_counts(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    assert st.write([item(i) for i in range(4)]) == [STORED] * 4
    assert st.write([item(i) for i in range(4, 8)]) == [STORED] * 4
    assert ids(st, "transitions") == ["t3", "t4", "t5", "t6", "t7"]
    assert st.count("transitions") == 5 and st.state["evicted"]["transitions"] == 3
    assert st.bounds("transitions") == (3, 8)
    assert st.state["counters"]["stored_transitions"] == 8


def test_dedup_within_a_batch_and_across_batches(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    assert st.write([item(1), item(2), item(1)]) == [STORED, STORED, DUPLICATE]
    assert st.write([item(2), item(3)]) == [DUPLICATE, STORED]
    assert ids(st, "transitions") == ["t1", "t2", "t3"]
    assert st.state["counters"]["duplicates"] == 2 and st.state["counters"]["stored_transitions"] == 3


def test_shared_counter_maps_count_once_per_stored_item(tmp_path):
    # the broker's gate results share one counters map per shape: a duplicate adds nothing, a
    # map used by three stored items adds three times, and the maps themselves stay unchanged
    st = ReplayStore(tmp_path, CAPS)
    kept = {"stored_transitions": 1, "gate_ws_imagined": 1}
    other = {"stored_transitions": 1, "gate_ag_open": 1}
    batch = [WriteItem(f"t:{i}".encode(), [("transitions", b"x")], kept if i != 3 else other) for i in range(4)]
    assert st.write(batch + [WriteItem(b"t:0", [("transitions", b"x")], kept)]) == [STORED] * 4 + [DUPLICATE]
    c = st.state["counters"]
    assert (c["stored_transitions"], c["gate_ws_imagined"], c["gate_ag_open"], c["duplicates"]) == (4, 3, 1, 1)
    assert kept == {"stored_transitions": 1, "gate_ws_imagined": 1}


def test_dedup_index_is_a_bounded_ring(tmp_path):
    st = ReplayStore(tmp_path, CAPS, dedup_capacity=3)
    st.write([item(i) for i in range(5)])
    assert st.state["dedup"] == [2, 5]
    assert not st.is_duplicate(b"t:0") and not st.is_duplicate(b"t:1") and st.is_duplicate(b"t:4")
    assert st.write([item(4)]) == [DUPLICATE]


def test_everything_is_recovered_on_reopen(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    st.write([item(i, stores=("transitions", "reflections")) for i in range(7)], {"reject_bad_field": 4})
    st.set_registry({"phase": "coevolve", "versions": {"policy": 2}, "adapters": {"policy": "policy-v2"}, "step": 9})
    state = st.state
    st.close()
    st2 = ReplayStore(tmp_path, CAPS)
    assert st2.state == state and st2.registry["adapters"] == {"policy": "policy-v2"}
    assert st2.state["counters"]["reject_bad_field"] == 4
    assert st2.write([item(6), item(7)]) == [DUPLICATE, STORED]  # dedup index survived
    assert ids(st2, "transitions")[-1] == "t7" and st2.bounds("transitions") == (3, 8)
    assert st2.bounds("reflections") == (2, 7)


def test_map_grows_instead_of_failing(tmp_path):
    st = ReplayStore(
        tmp_path,
        {"transitions": 10_000, "reflections": 5, "demos": 5, "episodes": 5},
        map_size_mb=1,
        max_map_size_mb=64,
    )
    for b in range(10):  # 10 x 50 x 20 KB = 10 MB through a 1 MB map
        assert st.write([item(b * 50 + i, size=20_000) for i in range(50)]) == [STORED] * 50
    assert st.map_grown >= 3 and st.info()["map_size"] > 8 << 20
    assert st.count("transitions") == 500


def test_map_limit_refuses_with_clear_error_and_changes_nothing(tmp_path):
    st = ReplayStore(
        tmp_path, {"transitions": 10_000, "reflections": 5, "demos": 5, "episodes": 5}, map_size_mb=1, max_map_size_mb=2
    )
    stored = 0
    with pytest.raises(StoreRefused, match="max_map_size_mb"):
        for b in range(100):
            st.write([item(b * 10 + i, size=20_000) for i in range(10)])
            stored += 10
    state = st.state
    assert st.count("transitions") == stored and len(ids(st, "transitions")) == stored
    assert st.last_error and "map is full" in st.last_error
    st.close()
    st2 = ReplayStore(
        tmp_path, {"transitions": 10_000, "reflections": 5, "demos": 5, "episodes": 5}, map_size_mb=1, max_map_size_mb=2
    )
    assert st2.state == state and len(ids(st2, "transitions")) == stored  # intact, readable


def test_disk_full_refuses_then_recovers(tmp_path):
    """A real I/O failure during commit (file size limit, like a full disk) in a child process."""
    script = textwrap.dedent(f"""
        import resource, signal, os, msgpack
        from broker.store import ReplayStore, StoreRefused, WriteItem
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        st = ReplayStore({str(tmp_path)!r}, {{"transitions": 100000, "reflections": 5, "demos": 5, "episodes": 5}},
                         map_size_mb=64)
        mk = lambda i: WriteItem(b"t:%d" % i, [("transitions", msgpack.packb({{"id": i, "p": "x" * 1000}}))])
        st.write([mk(i) for i in range(10)])
        size = os.path.getsize(os.path.join({str(tmp_path)!r}, "data.mdb"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100_000, resource.RLIM_INFINITY))
        try:
            for b in range(1, 50):
                st.write([mk(b * 100 + i) for i in range(100)])
            print("NO-ERROR")
        except StoreRefused as exc:
            print("REFUSED", exc)
        before = st.count("transitions")
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        st.write([mk(999_999)])
        print("AFTER", before, st.count("transitions"), len(list(st.iter_store("transitions"))))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
    assert "REFUSED" in lines and "LMDB write failed" in lines["REFUSED"]
    before, after, listed = map(int, lines["AFTER"].split())
    assert after == before + 1 == listed  # the failed transaction left nothing half-written


def test_unknown_store_name_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown stores"):
        ReplayStore(tmp_path, {"transitionz": 3})


def test_a_replay_written_before_a_store_existed_opens_read_only_with_that_store_empty(tmp_path):
    """A run's replay from before the ``imagined`` store (``experiments/studies/reflect_discrimination.py``
    reads old runs read-only): the stores it holds read as written, the new one as empty."""
    import lmdb

    from broker.store import _KEY, ReplayStore
    from comap_async.wire.messages import STORES

    env = lmdb.open(str(tmp_path), max_dbs=16)
    dbs = {n: env.open_db(n.encode()) for n in (*STORES, "dedup", "dedup_order", "meta") if n != "imagined"}
    with env.begin(write=True) as txn:
        txn.put(_KEY.pack(0), b"reflection 0", db=dbs["reflections"])
    env.close()

    store = ReplayStore(tmp_path, {"reflections": 10}, readonly=True)
    try:
        assert list(store.iter_store("reflections")) == [b"reflection 0"]
        assert list(store.iter_store("imagined")) == [] and store.get_many("imagined", [0, 1]) == [None, None]
        assert store.count("imagined") == 0
    finally:
        store.close()


def test_a_fork_cut_drops_later_records_stamped_or_by_version(tmp_path):
    """``cut_after``: stamped records after the limit go, and so do unstamped ones (reflection
    samples stored before they carried a stamp) from a policy version above the fork's."""
    st = ReplayStore(tmp_path, {"transitions": 10, "reflections": 10, "demos": 3, "episodes": 2})

    def put(i: int, store: str, **fields) -> WriteItem:
        return WriteItem(f"{store}:{i}".encode(), [(store, msgpack.packb({"id": f"{store}{i}", **fields}))], {})

    st.write([put(i, "transitions", ts=100.0 + i) for i in range(4)])
    reflections = [put(0, "reflections", ts=99.0, policy_version=4), put(1, "reflections", policy_version=19)]
    reflections += [put(2, "reflections", policy_version=20), put(3, "reflections", ts=0.0, policy_version=21)]
    st.write(reflections)
    assert st.cut_after(101.5, version_limit=19) == {
        "transitions": 2,
        "reflections": 2,
        "demos": 0,
        "episodes": 0,
        "imagined": 0,
    }
    assert ids(st, "transitions") == ["transitions0", "transitions1"]
    assert ids(st, "reflections") == ["reflections0", "reflections1"]
