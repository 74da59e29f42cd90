"""The actor outbox against real sockets: backpressure, spill to disk, rejects."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from actors.outbox import Outbox
from comap_async.protocol import ProtocolError, empty_registry
from tests.fixtures.broker import make_transition
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
    registries: list[dict] = []
    out = await Outbox(f"tcp://127.0.0.1:{port}", ack_timeout_s=0.3, on_registry=registries.append,
                       on_reject=lambda i, e: rejected.append((i, e))).start()
    await out.put(make_transition(0, actor="r"))
    reg = {**empty_registry(), "phase": "coevolve"}

    async def reply(ok: bool, retry: bool) -> int:
        ident, data = await asyncio.wait_for(router.recv_multipart(), 5)
        seq = msgpack.unpackb(data)["seq"]
        ack = {"v": 1, "type": "ack", "seq": seq, "ok": ok, "error": None if ok else "nope", "registry": reg,
               "retry": retry}
        await router.send_multipart([ident, msgpack.packb(ack)])
        return seq

    first = await reply(False, True)  # storage refused: must come back after the timeout
    assert await reply(False, False) == first  # the resend; now a permanent reject
    await out.flush(5)
    assert out.stats["refused"] == 1 and out.stats["rejected"] == 1 and out.stats["resent"] >= 1
    assert rejected == [("r:ep0:0", "nope")] and registries == [reg] and out.registry == reg
    await out.close()
    router.close(0)
    ctx.destroy()
