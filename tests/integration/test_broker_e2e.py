"""A real broker subprocess with real sockets: store, gates, registry on acks, sampling, HTTP, SIGTERM."""

from __future__ import annotations

import asyncio
import json

import msgpack
import zmq
import zmq.asyncio

from actors.registry_view import RegistryView
from broker.store import ReplayStore
from comap_async.method.gates import derive_policy_sample
from comap_async.wire.broker_client import BrokerClient, BrokerError
from comap_async.wire.outbox import Outbox
from comap_async.wire.protocol import validate
from tests.fixtures.broker import make_episode, make_transition

TOKEN = "s3cret-token"


async def test_store_gates_registry_sampling_http(broker_factory):
    bp = broker_factory([f"broker.http_token={TOKEN}", "broker.max_staleness=1"])
    view = RegistryView()
    # warmup (expert executed), coevolve with an accepted revision, coevolve with a low-confidence one
    warm = [make_transition(i, phase="warmup", policy_version=0) for i in range(3)]
    revised = make_transition(
        10,
        decision="REVISE",
        p_revise=0.9,
        q_ref=0.8,
        a_ref="open fridge 1",
        a_exec="open fridge 1",
        s_hat_exec="You open the fridge 1. The fridge 1 is open. In it, you see nothing.",
        s_hat_teacher="You open the fridge 1. The fridge 1 is open. In it, you see nothing.",
        s_next="You open the fridge 1. The fridge 1 is open. In it, you see a egg 1.",
        policy_version=3,
    )
    lowconf = make_transition(
        11,
        decision="REVISE",
        p_revise=0.9,
        q_ref=0.3,
        a_ref="open fridge 1",
        s_hat_teacher="Nothing happens.",
        policy_version=3,
    )
    async with BrokerClient(bp.learner_endpoint, timeout_s=5) as client:
        out = await Outbox(bp.actor_endpoint, ack_timeout_s=1.0, on_registry=view.update).start()
        for m in [*warm, revised, lowconf, make_episode(0)]:
            await out.put(m)
        await out.flush(10)
        assert view.known and view.phase() == "warmup"
        reg = await client.announce(
            "coevolve", {"policy": 3, "wm": 2, "wm_teacher": 2}, {"policy": "policy-v3", "wm": "wm-v2"}, step=60
        )
        assert reg["versions"]["policy"] == 3
        await out.put(make_transition(12, policy_version=3))
        await out.flush(10)
        # the registry rides on the next ack
        assert view.adapter("policy") == "policy-v3" and view.phase() == "coevolve" and view.changes == 2
        await out.close()

        demos = await client.sample("demos", 10, seed=1)
        assert sorted(d["id"] for d in demos.items) == sorted(t["id"] for t in warm)
        assert all(d["target"] == "take apple 1 from countertop 1" and d["source"] == "expert" for d in demos.items)
        refl = await client.sample("reflections", 10, seed=1)
        # warmup transitions (policy v0) derive no reflection sample; v3 samples are fresh
        by_id = {r["id"]: r for r in refl.items}
        assert set(by_id) == {revised["id"], lowconf["id"], "a0:ep0:12"}
        for tr in (revised, lowconf):
            want = derive_policy_sample(validate({**tr, "seq": 0}), 0.5, 0.6, 0.6)
            got = by_id[tr["id"]]
            for k in ("s_bar", "target", "y", "ws_score", "ws_imagined", "ag_reason"):
                assert got[k] == getattr(want, k), k
        assert by_id[revised["id"]]["target"] == "open fridge 1" and by_id[revised["id"]]["y"] == 1
        assert by_id[lowconf["id"]]["target"] == lowconf["a_draft"] and by_id[lowconf["id"]]["y"] == 0
        trs = await client.sample("transitions", 10, seed=2)
        # max_staleness=1 with current policy 3: the three v0 warmup transitions are not served
        assert trs.stale_skipped == 3 and len(trs.items) == 3 and "seq" not in trs.items[0]
        again = await client.sample("transitions", 10, seed=2)
        assert [t["id"] for t in again.items] == [t["id"] for t in trs.items]
        with_error = None
        try:
            await client.sample("transitions", 0)
        except BrokerError as exc:
            with_error = str(exc)
        assert with_error and "n must be" in with_error

        stats = await client.get_stats()
    assert stats["stores"]["transitions"]["count"] == 6 and stats["stores"]["episodes"]["count"] == 1
    assert stats["gates"]["action_revised"] == 1 and stats["gates"]["action_total"] == 3
    assert stats["stale_skipped"]["transitions"] == 6
    assert "a0" in stats["actors"]
    assert bp.http("/stats")[0] == 401 and bp.http("/metrics", "wrong")[0] == 401
    http_stats = json.loads(bp.http("/stats", TOKEN)[1])
    assert http_stats["ingest"]["stored_total"] == 7
    status, metrics = bp.http("/metrics", TOKEN)
    assert status == 200 and 'comap_broker_store_items{store="transitions"} 6.0' in metrics
    assert 'comap_broker_registry_version{role="policy"} 3.0' in metrics
    assert bp.terminate() == 0
    # after a clean stop the LMDB holds the same, including the announced registry
    store = ReplayStore(bp.replay_dir, {"transitions": 10}, readonly=True)
    assert store.count("transitions") == 6 and store.registry["adapters"]["policy"] == "policy-v3"
    store.close()


async def test_sigterm_commits_and_acks_queued_messages(broker_proc):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(broker_proc.actor_endpoint)
    n = 500
    for i in range(n):
        await sock.send(msgpack.packb({**make_transition(i, actor="q", phase="warmup"), "seq": i}))
    first = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
    broker_proc.proc.send_signal(15)  # while most messages are queued or in a batch
    acked = {first["seq"]}
    try:
        while len(acked) < n:
            ack = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 3))
            assert ack["ok"], ack
            acked.add(ack["seq"])
    except TimeoutError:
        pass
    assert broker_proc.proc.wait(20) == 0
    sock.close(0)
    ctx.term()
    store = ReplayStore(broker_proc.replay_dir, {"transitions": 10}, readonly=True)
    # every acked message is stored; messages the broker never read were neither stored nor acked
    ids = {msgpack.unpackb(v)["id"] for v in store.iter_store("transitions")}
    assert {f"q:ep0:{s}" for s in acked} <= ids
    assert len(ids) == store.count("transitions") >= len(acked) > 0
    store.close()
