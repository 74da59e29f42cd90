"""The actor outbox against real sockets: backpressure, spill to disk, rejects."""

from __future__ import annotations

import asyncio
import signal
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from actors.registry_view import RegistryView
from comap_async.wire.messages import Registry
from comap_async.wire.outbox import Outbox
from comap_async.wire.protocol import ProtocolError, empty_registry
from tests.fixtures.broker import make_transition, stored
from tests.fixtures.core import free_port


async def test_outbox_blocks_when_full_and_spills_until_a_broker_acks(broker_factory, tmp_path):
    bp = broker_factory(start=False)
    spill = tmp_path / "spill"
    out = await Outbox(bp.actor_endpoint, max_pending=3, ack_timeout_s=0.3, spill_dir=spill).start()
    for i in range(3):
        await out.put(make_transition(i, actor="sp"))
    with pytest.raises(TimeoutError):  # full and no broker: put waits (backpressure), nothing is dropped
        await asyncio.wait_for(out.put(make_transition(3, actor="sp")), 0.5)
    await out.close()
    assert len(list(spill.glob("*.msg"))) == 3  # an actor "crash" here keeps them on disk

    await asyncio.to_thread(bp.start)
    out2 = await Outbox(bp.actor_endpoint, max_pending=3, ack_timeout_s=0.3, spill_dir=spill).start()
    assert out2.pending == 3
    await out2.put(make_transition(3, actor="sp"))
    await out2.flush(10)
    await out2.close()
    assert list(spill.glob("*.msg")) == []
    assert bp.stats()["stores"]["transitions"]["count"] == 4


async def test_ack_log_names_each_acked_message_once_its_ack_arrives(broker_factory, tmp_path):
    """``ack_log``: a line per ack, spilled messages resent by a restarted outbox included; nothing
    for a message the broker has not acked."""
    bp = broker_factory(start=False)
    spill, log = tmp_path / "spill", tmp_path / "acked.log"
    out = await Outbox(bp.actor_endpoint, ack_timeout_s=0.3, spill_dir=spill, ack_log=log).start()
    await out.put(make_transition(0, actor="al"))
    await out.close()  # no broker yet: kept in the spill directory, nothing acked
    assert log.read_text() == ""

    await asyncio.to_thread(bp.start)
    out2 = await Outbox(bp.actor_endpoint, ack_timeout_s=0.3, spill_dir=spill, ack_log=log).start()
    await out2.put(make_transition(1, actor="al"))
    await out2.flush(10)
    await out2.close()
    assert log.read_text().splitlines() == ["transition al:ep0:0", "transition al:ep0:1"]
    assert {t["id"] for t in stored(bp, "transitions")} == {"al:ep0:0", "al:ep0:1"}


async def test_outbox_rejects_invalid_messages_locally():
    out = await Outbox(f"tcp://127.0.0.1:{free_port()}").start()
    with pytest.raises(ProtocolError):
        await out.put({**make_transition(0), "p_revise": "high"})
    await out.close()
    assert out.pending == 0


async def test_permanent_reject_is_dropped_and_temporary_refusal_is_resent():
    """A scripted ROUTER plays the broker: first a refusal (retry), then a reject (no retry)."""
    port = free_port()
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    rejected: list[tuple[str, str]] = []
    view = RegistryView()
    out = await Outbox(
        f"tcp://127.0.0.1:{port}",
        ack_timeout_s=0.3,
        on_registry=view.update,
        on_reject=lambda i, e: rejected.append((i, e)),
    ).start()
    await out.put(make_transition(0, actor="r"))
    reg = {**empty_registry(), "phase": "coevolve"}

    async def reply(ok: bool, retry: bool) -> int:
        ident, data = await asyncio.wait_for(router.recv_multipart(), 5)
        seq = msgpack.unpackb(data)["seq"]
        ack = {
            "v": 1,
            "type": "ack",
            "seq": seq,
            "ok": ok,
            "error": None if ok else "nope",
            "registry": reg,
            "retry": retry,
        }
        await router.send_multipart([ident, msgpack.packb(ack)])
        return seq

    first = await reply(False, True)  # storage refused: must come back after the timeout
    assert await reply(False, False) == first  # the resend; now a permanent reject
    await out.flush(5)
    assert out.stats["refused"] == 1 and out.stats["rejected"] == 1 and out.stats["resent"] >= 1
    assert rejected == [("r:ep0:0", "nope")] and view.changes == 1 and view.get() == Registry(phase="coevolve")
    await out.close()
    router.close(0)
    ctx.destroy()


async def test_broker_drains_actors_that_flush_while_it_stops(broker_factory):
    """honcho signals broker and actors at once: messages put right after the broker's SIGTERM
    are still stored and acked, so the actors' shutdown flush completes (within DRAIN_QUIET_S of quiet)."""
    bp = broker_factory()
    out = await Outbox(bp.actor_endpoint, ack_timeout_s=0.5).start()
    for i in range(20):
        await out.put(make_transition(i, actor="dr"))
    await out.flush(10)
    bp.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.1)  # the broker has the signal now; it stops only after a quiet spell (0.5 s)
    for i in range(20, 60):
        await out.put(make_transition(i, actor="dr"))
    await out.flush(5)
    await out.close()
    assert await asyncio.to_thread(bp.proc.wait, 30) == 0
    log = bp.log_text()
    assert '"stored_total": 60' in log, log[-2000:]

    bp.start()  # and they are really in LMDB
    assert bp.stats()["stores"]["transitions"]["count"] == 60
    t0 = time.monotonic()
    assert bp.terminate() == 0
    assert time.monotonic() - t0 < 5.0  # no actor traffic: the drain does not wait


async def test_outbox_close_is_bounded_and_says_what_it_could_not_deliver(tmp_path):
    events: list[tuple[str, dict]] = []

    class Log:
        def __getattr__(self, level):
            return lambda event, **kw: events.append((event, kw))

    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: acks never come
    out = await Outbox(endpoint, ack_timeout_s=0.2, log=Log()).start()
    for i in range(3):
        await out.put(make_transition(i, actor="nb"))
    t0 = time.monotonic()
    await out.close(flush_timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    assert ("outbox.close_unflushed", {"pending": 3, "spilled_to": None, "lost": 3}) in events

    events.clear()
    spill = tmp_path / "spill"
    out = await Outbox(endpoint, ack_timeout_s=0.2, log=Log(), spill_dir=spill).start()
    await out.put(make_transition(9, actor="nb"))
    await out.close(flush_timeout=0.0)
    assert ("outbox.close_unflushed", {"pending": 1, "spilled_to": str(spill), "lost": 0}) in events
    assert len(list(spill.glob("*.msg"))) == 1


async def test_outbox_delivers_in_put_order_while_connecting(broker_factory):
    """Messages put before the connection is up wait in order; later puts must not overtake them
    once it is, so the broker stores one actor's stream in the order it was put (both for an
    outbox started next to a running broker and for a broker that starts late)."""
    from broker.store import ReplayStore

    for late in (False, True):
        bp = broker_factory(["broker.gate_workers=0"], start=not late)
        out = await Outbox(bp.actor_endpoint, max_pending=1000, ack_timeout_s=60).start()
        starting = asyncio.create_task(asyncio.to_thread(bp.start)) if late else None
        n = 0
        while n < 600 or (starting is not None and not starting.done()):
            await out.put(make_transition(n, actor="ord"))  # as fast as the loop allows
            n += 1
            if n % 50 == 0:
                await asyncio.sleep(0.001)
        if starting is not None:
            await starting
        await out.flush(30)
        await out.close()
        assert out.stats["acked"] == n and out.stats["resent"] == 0
        assert bp.terminate() == 0
        store = ReplayStore(bp.replay_dir, {"transitions": 1}, readonly=True)
        try:
            stored = [msgpack.unpackb(v)["t"] for v in store.iter_store("transitions")]
        finally:
            store.close()
        assert stored == list(range(n)), (
            f"late={late}: first out of order at {next(i for i, t in enumerate(stored) if t != i)}"
        )
