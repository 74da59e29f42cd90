"""A peer that floods the broker and never reads its acks: the broker's memory stays bounded
(``broker.server.ACK_QUEUE_MAX`` replies per peer), and an honest actor beside it keeps exactly-once."""

from __future__ import annotations

import asyncio
import os
import time

import zmq
import zmq.asyncio

from broker.server import ACK_QUEUE_MAX
from comap_async.wire.outbox import Outbox
from tests.fixtures.broker import make_transition, stored

FLOOD_S = float(os.environ.get("COMAP_FLOOD_S", "20"))  # the acceptance ran it for 60 s
BOUND_MB = 120  # growth allowed: ~ACK_QUEUE_MAX queued error acks (5 MB per 20,000 measured) and slack


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_a_non_reading_peer_cannot_grow_the_broker_and_an_honest_actor_loses_nothing(broker_factory):
    assert ACK_QUEUE_MAX == 50_000
    bp = broker_factory()
    await asyncio.sleep(1.0)
    before = rss_mb(bp.proc.pid)
    ctx = zmq.asyncio.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.rcvhwm = 10  # its own queue fills at once: what it is sent then waits at the broker
    flood.connect(bp.actor_endpoint)
    sent = 0

    async def flooder() -> None:
        nonlocal sent
        deadline = time.monotonic() + FLOOD_S
        while time.monotonic() < deadline:
            for _ in range(500):
                await flood.send(b"")  # an empty frame: each one earns an error ack
            sent += 500

    async def honest() -> Outbox:
        out = await Outbox(bp.actor_endpoint, ack_timeout_s=1.0).start()
        for i in range(300):
            await out.put(make_transition(i, actor="honest"))
            await asyncio.sleep(FLOOD_S / 400)
        await out.flush(60)
        await out.close()
        return out

    peak = before
    task = asyncio.create_task(flooder())
    out_task = asyncio.create_task(honest())
    while not task.done():
        await asyncio.sleep(0.5)
        peak = max(peak, rss_mb(bp.proc.pid))
    await task
    out = await out_task
    flood.close(0)
    ctx.term()
    assert sent > 2 * ACK_QUEUE_MAX, sent  # the flood outran the bound (100,000 frames, as before)
    print(f"flood frames={sent} broker_rss_before_mb={before:.0f} peak_mb={peak:.0f} growth_mb={peak - before:.0f}")
    assert peak - before < BOUND_MB, (before, peak)
    assert out.stats["acked"] == 300
    honest_ids = [t["id"] for t in stored(bp, "transitions") if t["actor"] == "honest"]
    assert len(honest_ids) == len(set(honest_ids)) == 300  # exactly once
    assert bp.proc.poll() is None
