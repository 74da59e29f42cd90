"""With CURVE on, only clients holding an authorised key get anything stored."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgpack
import pytest
import zmq
import zmq.asyncio

from comap_async.wire.broker_client import BrokerClient, BrokerError
from comap_async.wire.curve import ClientKeys, load_client_keys
from comap_async.wire.outbox import Outbox
from tests.fixtures.broker import REPO, make_transition


def _peer_count(stats: dict, *names: str) -> int:
    return sum(stats["peers"].get(f"actor_{n}", 0) for n in names)


async def _send_raw(endpoint: str, keys: ClientKeys | None, n: int = 3) -> int:
    """Send ``n`` valid transitions over a plain DEALER; returns how many acks came back in 1.5 s."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        keys.apply(sock)
    sock.connect(endpoint)
    for i in range(n):
        try:
            await asyncio.wait_for(sock.send(msgpack.packb({**make_transition(i, actor="intruder"), "seq": i})), 1.0)
        except TimeoutError:
            break
    got = 0
    try:
        while True:
            await asyncio.wait_for(sock.recv(), 1.5)
            got += 1
    except TimeoutError:
        pass
    sock.close(0)
    ctx.term()
    return got


async def test_curve_only_authorised_clients_store(broker_factory, tmp_path):
    keys_dir = tmp_path / "keys"
    res = subprocess.run(
        [sys.executable, "-m", "comap_async", "keys", "--out", str(keys_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0 and "No module named comap_async.__main__" in res.stderr:  # pragma: no cover
        res = subprocess.run(["comap", "keys", "--out", str(keys_dir)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (keys_dir / "server.key_secret").stat().st_mode & 0o077 == 0
    bp = broker_factory(["broker.curve=true", f"broker.keys_dir={keys_dir}"])
    good = load_client_keys(keys_dir)

    # 1) no CURVE at all, 2) an unauthorised client key, 3) the wrong server key
    pub, sec = zmq.curve_keypair()
    rogue = ClientKeys(pub, sec, good.server_public)
    spub, _ = zmq.curve_keypair()
    wrong_server = ClientKeys(good.public, good.secret, spub)
    before = bp.stats()
    assert await _send_raw(bp.actor_endpoint, None) == 0
    assert await _send_raw(bp.actor_endpoint, rogue) == 0
    assert await _send_raw(bp.actor_endpoint, wrong_server) == 0
    with pytest.raises(BrokerError, match="no reply"):
        async with BrokerClient(bp.learner_endpoint, timeout_s=1.0, retries=0, client_keys=rogue) as c:
            await c.get_stats()
    stats = bp.stats()
    assert stats["stores"]["transitions"]["count"] == 0 and stats["ingest"]["stored_total"] == 0
    assert "intruder" not in stats["actors"]
    assert _peer_count(stats, "handshake_failed_auth") >= 1  # the rogue key, refused by the allow-list
    assert (
        _peer_count(stats, "handshake_failed_protocol", "handshake_failed_no_detail") >= 2
    )  # no CURVE / bad server key
    assert stats["peers"].get("learner_handshake_failed_auth", 0) >= 1
    assert _peer_count(before, "handshake_failed_auth") == 0

    # the authorised key works for actors and learners
    out = await Outbox(bp.actor_endpoint, ack_timeout_s=1.0, client_keys=good).start()
    for i in range(5):
        await out.put(make_transition(i, actor="trusted"))
    await out.flush(10)
    await out.close()
    async with BrokerClient(bp.learner_endpoint, timeout_s=5, client_keys=good) as c:
        stats = await c.get_stats()
    assert stats["stores"]["transitions"]["count"] == 5 and stats["curve"] is True
    assert bp.terminate() == 0


def test_broker_refuses_curve_without_keys(broker_factory, tmp_path):
    bp = broker_factory(["broker.curve=true", f"broker.keys_dir={tmp_path / 'nokeys'}"], start=False)
    with pytest.raises(RuntimeError, match="comap keys"):
        bp.start(timeout=15)
