"""Gate worker processes: a worker killed mid-stream loses nothing (its batches are gated in the
broker and a new worker starts), a SIGKILLed broker takes its workers with it, and the in-process
mode (``broker.gate_workers=0``) stores the same records."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time

import msgpack

from broker.actor_path import GROUP_COMMIT
from broker.store import ReplayStore
from comap_async.wire.outbox import Outbox
from tests.fixtures.broker import make_transition
from tests.fixtures.processes import alive

N = 3000


async def _send(bp, n: int, on_progress=None) -> Outbox:
    ob = await Outbox(bp.actor_endpoint, ack_timeout_s=1.0, max_pending=256).start()
    for i in range(n):
        await ob.put(
            make_transition(
                i,
                text_len=300,
                s_hat_teacher="Nothing happens." if i % 3 else "You pick up the apple 1 from the countertop 1.",
            )
        )
        if on_progress is not None and i % 100 == 0:
            await on_progress(i)
    await ob.flush(60)
    return ob


def _stored_records(bp) -> tuple[list[str], list[dict]]:
    store = ReplayStore(bp.replay_dir, {"transitions": 1}, readonly=True)
    try:
        ids = [msgpack.unpackb(v)["id"] for v in store.iter_store("transitions")]
        refl = [msgpack.unpackb(v) for v in store.iter_store("reflections")]
    finally:
        store.close()
    return ids, refl


async def test_killed_gate_worker_loses_nothing(broker_factory):
    bp = broker_factory(
        [
            "broker.gate_workers=1",
            f"broker.capacity={2 * N}",
        ]
    )
    first = bp.stats()["gate_workers"]["pids"]
    assert len(first) == 1 and alive(first[0])
    killed = []

    async def kill_once(i: int) -> None:
        if i >= N // 3 and not killed:
            os.kill(first[0], signal.SIGKILL)
            killed.append(i)

    ob = await _send(bp, N, kill_once)
    stats = bp.stats()
    await ob.close()
    assert killed and ob.stats["acked"] == N and ob.stats["rejected"] == 0
    assert stats["gate_workers"]["restarts"] == 1
    (second,) = stats["gate_workers"]["pids"]
    assert second != first[0] and alive(second)
    assert "broker.gate_worker_died" in bp.log_text()
    assert bp.terminate() == 0
    assert not alive(second), "the broker left its gate worker behind on SIGTERM"
    ids, refl = _stored_records(bp)
    assert collections.Counter(ids) == collections.Counter(f"a0:ep0:{i}" for i in range(N))
    assert sorted(r["id"] for r in refl) == sorted(ids)


async def test_sigkilled_broker_takes_its_gate_workers_with_it(broker_factory):
    bp = broker_factory(["broker.gate_workers=2"])
    pids = bp.stats()["gate_workers"]["pids"]
    assert len(pids) == 2 and all(map(alive, pids))
    bp.kill()
    deadline = time.monotonic() + 5
    while any(map(alive, pids)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not any(map(alive, pids)), "gate workers outlived a SIGKILLed broker"


async def test_in_process_gating_stores_the_same_samples(broker_factory):
    results = []
    for workers in (0, 2):
        bp = broker_factory(
            [
                f"broker.gate_workers={workers}",
                "broker.capacity=1000",
            ]
        )
        assert len(bp.stats()["gate_workers"]["pids"]) == workers
        ob = await _send(bp, 300)
        await ob.close()
        assert bp.terminate() == 0
        ids, refl = _stored_records(bp)
        assert ids == [f"a0:ep0:{i}" for i in range(300)]  # one outbox: stored in put order
        results.append(sorted(({k: v for k, v in r.items() if k != "ts"} for r in refl), key=lambda r: r["id"]))
    assert results[0] == results[1]
    assert {r["ws_imagined"] for r in results[0]} == {True, False}


async def test_broker_gates_batches_itself_while_its_worker_is_stopped(broker_factory):
    """With its worker stopped (SIGSTOP) and its queue full, the broker process gates the batches
    that keep coming itself; once the worker runs again it returns its own. Every message is still stored exactly once,
    with the samples the worker would have made."""
    n = 10 * GROUP_COMMIT  # the worker holds two batches; the outbox keeps four in flight, so two wait for it
    bp = broker_factory(["broker.gate_workers=1", f"broker.capacity={2 * n}"])
    (worker,) = bp.stats()["gate_workers"]["pids"]
    ob = await Outbox(bp.actor_endpoint, ack_timeout_s=5.0, max_pending=4 * GROUP_COMMIT).start()
    os.kill(worker, signal.SIGSTOP)

    async def put_all() -> None:
        for i in range(n):
            pick = f"You pick up the apple {i + 1} from the countertop {i + 1}."
            await ob.put(
                make_transition(
                    i,
                    o=f"You arrive at countertop {i + 1}.",
                    s_hat_exec=pick,
                    s_hat_teacher=pick if i % 2 else "Nothing happens.",
                    s_next=pick,
                )
            )

    sending = asyncio.ensure_future(put_all())
    try:
        # the worker holds the first batches; commits wait for them (they are stored in order), and
        # meanwhile the broker gates what the outbox keeps sending
        await asyncio.sleep(3.0)
    finally:
        os.kill(worker, signal.SIGCONT)
    await sending
    await ob.flush(120)
    stats = bp.stats()
    await ob.close()
    assert ob.stats["acked"] == n and ob.stats["rejected"] == 0
    here = stats["gate_workers"]["batches_gated_in_broker"]
    assert stats["gate_workers"]["restarts"] == 0
    assert 0 < here < n // GROUP_COMMIT, f"{here} of {n // GROUP_COMMIT} batches gated in the broker process"
    assert bp.terminate() == 0
    ids, refl = _stored_records(bp)
    assert collections.Counter(ids) == collections.Counter(f"a0:ep0:{i}" for i in range(n))
    by_id = {r["id"]: r for r in refl}
    assert len(by_id) == n
    for i in range(n):  # the gate decided each sample as the worker would: agreement iff same text
        assert by_id[f"a0:ep0:{i}"]["ws_imagined"] is bool(i % 2)
