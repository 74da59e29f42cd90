"""Three actors, 10,000 transitions, the broker SIGKILLed and restarted twice mid-stream;
afterwards every transition id is stored exactly once and the counters agree."""

from __future__ import annotations

import asyncio
import collections

import msgpack

from broker.store import ReplayStore
from comap_async.wire.outbox import Outbox
from tests.fixtures.broker import make_transition

N_TOTAL = 10_000
ACTORS = ("a0", "a1", "a2")


async def test_exactly_once_across_two_sigkills(broker_factory):
    bp = broker_factory(
        [
            "broker.capacity=20000",
            "broker.window=2000",
        ]
    )
    counts = [N_TOTAL // 3 + (1 if i < N_TOTAL % 3 else 0) for i in range(3)]
    outboxes = [await Outbox(bp.actor_endpoint, ack_timeout_s=1.0, max_pending=256).start() for _ in ACTORS]
    sent = collections.Counter()

    async def actor(k: int) -> None:
        for i in range(counts[k]):
            await outboxes[k].put(make_transition(i, actor=ACTORS[k], text_len=200))
            sent[k] += 1
            if i % 200 == 0:  # keep traffic flowing across both kills
                await asyncio.sleep(0.02)

    async def killer() -> list[int]:
        stored_at_kill = []
        for threshold in (2_500, 6_000):
            while True:
                stored = (await asyncio.to_thread(bp.stats))["stores"]["transitions"]["count"]
                if stored >= threshold:
                    break
                await asyncio.sleep(0.02)
            bp.kill()
            stored_at_kill.append(stored)
            await asyncio.sleep(0.5)  # actors keep queueing and retrying while the broker is down
            await asyncio.to_thread(bp.start)
        return stored_at_kill

    kill_task = asyncio.create_task(killer())
    await asyncio.gather(*(actor(k) for k in range(3)))
    stored_at_kill = await asyncio.wait_for(kill_task, 120)
    for ob in outboxes:
        await ob.flush(60)
    assert bp.starts == 3
    assert all(s < N_TOTAL for s in stored_at_kill), f"kills happened after all was stored: {stored_at_kill}"

    stats = bp.stats()
    resent = sum(ob.stats["resent"] for ob in outboxes)
    acked = sum(ob.stats["acked"] for ob in outboxes)
    for ob in outboxes:
        await ob.close()
    assert acked == N_TOTAL and all(ob.stats["rejected"] == 0 for ob in outboxes)
    assert bp.terminate() == 0

    store = ReplayStore(bp.replay_dir, {"transitions": 1}, readonly=True)
    ids = [msgpack.unpackb(v)["id"] for v in store.iter_store("transitions")]
    refl_ids = [msgpack.unpackb(v)["id"] for v in store.iter_store("reflections")]
    expected = {f"{ACTORS[k]}:ep0:{i}" for k in range(3) for i in range(counts[k])}
    dupes = [i for i, c in collections.Counter(ids).items() if c > 1]
    assert not dupes, f"{len(dupes)} ids stored twice, e.g. {dupes[:5]}"
    assert set(ids) == expected and len(ids) == N_TOTAL
    assert sorted(refl_ids) == sorted(ids)
    counters = store.state["counters"]
    assert counters["stored_transitions"] == N_TOTAL == store.count("transitions") == store.count("reflections")
    assert store.state["dedup"][1] - store.state["dedup"][0] == N_TOTAL
    assert stats["stores"]["transitions"]["count"] == N_TOTAL and stats["ingest"]["stored_total"] == N_TOTAL
    # resends that reached a broker which had already committed them were recognised, not stored
    assert resent > 0 and counters.get("duplicates", 0) <= resent
    store.close()
