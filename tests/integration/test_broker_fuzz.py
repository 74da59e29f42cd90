"""10,000 malformed frames from raw ZeroMQ sockets; the broker keeps serving and counts them."""

from __future__ import annotations

import asyncio
import json
import random

import msgpack
import pytest
import zmq
import zmq.asyncio

from comap_async.wire.broker_client import BrokerClient
from comap_async.wire.outbox import Outbox
from tests.fixtures.broker import make_transition
from tests.fixtures.protocol_v1 import SCHEMAS  # the frozen v1 spec: which kinds are really wrong

N_FRAMES = 10_000
WRONG = {  # values of the wrong wire type for each schema field kind
    "str": [1, 1.5, True, [1], {"a": 1}, b"\x00\x01"],
    "int": ["7", 1.5, True, None, [1], b"\x07"],
    "float": ["0.5", True, None, {"x": 1}],
    "bool": [1, 0, "true", None, 1.0],
    "list_str": ["at(a 1)", [1, 2], [None], {"a": 1}, 3, [["nested"]], ["x" * 300]],
    "map": ["turns", 1, 1.5, True, [["go to desk 1", "Nothing happens."]], b"\x00"],
}
MAX_BYTES = 256 * 1024


def malformed_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    valid = make_transition(1, actor="fuzz")
    valid["seq"] = 1
    packed = msgpack.packb(valid)
    keys = list(valid)
    out: list[list[bytes]] = []
    for i in range(n):
        kind = i % 10
        if kind == 0:  # random bytes (sometimes empty)
            out.append([rng.randbytes(rng.randrange(0, 300))])
        elif kind == 1:  # truncated msgpack of a valid message
            out.append([packed[: rng.randrange(1, len(packed))]])
        elif kind == 2:  # a field of the wrong type (chosen from the schema so it is really wrong)
            m = dict(valid)
            name = rng.choice(keys[2:])
            spec = SCHEMAS["transition"][name]
            m[name] = rng.choice([v for v in WRONG[spec.kind] if not (v is None and spec.nullable)])
            out.append([msgpack.packb(m, use_bin_type=True)])
        elif kind == 3:  # a huge string (above the field limit, below the frame limit)
            m = dict(valid)
            m[rng.choice(["s", "o", "id", "s_next", "goal"])] = "z" * rng.randrange(70_000, 200_000)
            out.append([msgpack.packb(m)])
        elif kind == 4:  # unknown or malformed schema versions
            m = dict(valid)
            m["v"] = rng.choice([0, 2, 99, "1", 1.0, None, -1])
            out.append([msgpack.packb(m)])
        elif kind == 5:  # missing field / unknown field / unknown type / learner message
            m = dict(valid)
            choice = rng.randrange(4)
            if choice == 0:
                del m[rng.choice([k for k in keys[2:] if SCHEMAS["transition"][k].required])]
            elif choice == 1:
                m["x" * rng.randrange(1, 500)] = 1
            elif choice == 2:
                m["type"] = rng.choice(["transitionX", "", "ack", 5])
            else:
                m = {"v": 1, "type": "sample", "req": 1, "store": "demos", "n": 1}
            out.append([msgpack.packb(m)])
        elif kind == 6:  # not a map at top level, or deeply nested garbage
            out.append([msgpack.packb(rng.choice([[1, 2, 3], 42, "transition", None, [[[[[]]]]] * 50, {1: 2}]))])
        elif kind == 7:  # several frames in one message
            out.append([b"x" + rng.randbytes(8), msgpack.packb(valid)])
        elif kind == 8:  # out-of-range ints, NaN/inf floats, binary strings, bad enum values
            m = dict(valid)
            field, value = rng.choice(
                [
                    ("t", 1 << 63),
                    ("p_revise", float("nan")),
                    ("q_ref", float("inf")),
                    ("decision", "MAYBE"),
                    ("phase", "train"),
                    ("s", b"bytes"),
                    ("seq", 2**64 - 1),
                ]
            )
            m[field] = value
            out.append([msgpack.packb(m, use_bin_type=True)])
        else:  # msgpack ext types and invalid utf-8 in strings
            out.append([rng.choice([b"\xd4\x01\x02", b"\xa3\xff\xfe\xfd", b"\x81\xa1v\xc1", b"\xc1"])])
    return out


async def test_fuzz_frames_are_rejected_counted_and_broker_survives(broker_factory):
    bp = broker_factory([f"broker.max_message_bytes={MAX_BYTES}"])
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.rcvhwm = 0  # read every error ack
    sock.connect(bp.actor_endpoint)
    frames = malformed_frames(random.Random(1234), N_FRAMES)
    acks: list[dict] = []

    async def reader() -> None:
        while len(acks) < N_FRAMES:
            acks.append(msgpack.unpackb(await sock.recv()))

    read = asyncio.create_task(reader())
    for f in frames:
        await sock.send_multipart(f)
    try:
        await asyncio.wait_for(read, 60)
    except TimeoutError:  # say where the answers stopped: lost acks or a stalled broker
        st = bp.stats()
        raise AssertionError(
            f"{len(acks)} of {N_FRAMES} error acks after 60 s; broker: rejects "
            f"{st['rejects']['total']}, pending {st['pending']}, counters "
            f"{ {k: v for k, v in st['counters'].items() if 'drop' in k or 'error' in k} }"
        ) from None
    assert all(not a["ok"] and a["retry"] is False and a["error"] for a in acks)
    assert all(a["type"] == "ack" and a["v"] == 1 for a in acks)

    # learner port: garbage gets error replies too
    lsock = ctx.socket(zmq.DEALER)
    lsock.connect(bp.learner_endpoint)
    # (kind 5 includes a valid learner request, which would rightly be answered)
    for f in [f for i, f in enumerate(frames) if i % 10 != 5][:500]:
        await lsock.send_multipart(f)
    replies = [msgpack.unpackb(await asyncio.wait_for(lsock.recv(), 10)) for _ in range(500)]
    assert all(r["type"] == "reply" and not r["ok"] for r in replies)

    # an oversized frame: ZeroMQ (MAXMSGSIZE) drops that peer; nothing reaches the broker's code
    big = ctx.socket(zmq.DEALER)
    big.connect(bp.actor_endpoint)
    await big.send(b"\x00" * (MAX_BYTES + 10))
    await asyncio.sleep(0.5)

    status, body = bp.http("/healthz")
    assert status == 200 and json.loads(body)["ok"]
    async with BrokerClient(bp.learner_endpoint, timeout_s=5) as client:
        out = await Outbox(bp.actor_endpoint, ack_timeout_s=1.0).start()
        await out.put(make_transition(7, actor="good"))
        await out.flush(10)
        await out.close()
        assert out.stats["acked"] == 1
        assert (await client.get_registry())["phase"] == "warmup"
    stats = bp.stats()
    assert stats["rejects"]["total"] == N_FRAMES + 500
    for cat in (
        "not_msgpack",
        "bad_field",
        "bad_version",
        "unknown_type",
        "bad_frames",
        "wrong_socket",
        "not_a_map",
        "empty",
    ):
        assert stats["rejects"].get(cat, 0) > 0, cat
    assert stats["stores"]["transitions"]["count"] == 1
    assert stats["peers"].get("actor_disconnected", 0) >= 1
    assert bp.proc.poll() is None
    for s in (sock, lsock, big):
        s.close(0)
    ctx.term()
    assert bp.terminate() == 0


async def test_non_finite_numbers_in_free_form_maps_are_refused_and_http_stays_strict_json(broker_factory):
    """An episode's ``metrics``, an ``eval_result``'s ``result`` and an ``announce``'s ``metrics`` with
    NaN or an infinity are refused (they used to be acked and then break /stats and /records)."""
    from tests.fixtures.broker import make_episode

    bp = broker_factory()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(bp.actor_endpoint)
    for i, bad in enumerate([float("nan"), float("inf"), {"deep": [1.0, float("-inf")]}]):
        await sock.send(msgpack.packb({**make_episode(i, metrics={"delta_f1": bad}), "seq": i}))
        ack = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
        assert not ack["ok"] and ack["retry"] is False and "non-finite" in ack["error"], ack
    lsock = ctx.socket(zmq.DEALER)
    lsock.connect(bp.learner_endpoint)
    for req, msg in enumerate(
        [
            {"type": "eval_result", "version": 1, "result": {"success_rate": float("nan")}},
            {
                "type": "announce",
                "phase": "warmup",
                "versions": {},
                "adapters": {},
                "step": 0,
                "metrics": {"wm/ce": float("inf")},
            },
        ]
    ):
        await lsock.send(msgpack.packb({"v": 1, "req": req, **msg}))
        reply = msgpack.unpackb(await asyncio.wait_for(lsock.recv(), 10))
        assert not reply["ok"] and "non-finite" in reply["error"], reply
    async with Outbox(bp.actor_endpoint, ack_timeout_s=1.0) as out:  # a finite episode still lands
        await out.put(make_episode(9, metrics={"delta_f1": 0.5}))
        await out.flush(10)
    for path in ("/stats", "/records?store=episodes"):
        status, body = bp.http(path)
        assert status == 200
        json.loads(body, parse_constant=lambda c: pytest.fail(f"{path} emitted {c}"))  # strict JSON
    assert bp.stats()["stores"]["episodes"]["count"] == 1
    for s in (sock, lsock):
        s.close(0)
    ctx.term()


async def test_map_keys_that_are_not_strings_are_refused_and_every_reader_of_the_store_still_works(broker_factory):
    """A histogram keyed by ints (or a float, bytes, bool or nil key) in an episode's ``metrics`` is
    refused in one line naming the path, as other invalid messages are. Such an episode used to be
    acked and stored, and from then on ``/records``, the learner's sample of ``episodes`` and
    ``comap stats`` failed on every read of that store."""
    import os
    import subprocess
    import sys

    from tests.fixtures.broker import REPO, make_episode

    bp = broker_factory()
    async with Outbox(bp.actor_endpoint, ack_timeout_s=1.0) as out:
        await out.put(make_episode(0, metrics={"delta_f1": 0.5}))
        await out.flush(10)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(bp.actor_endpoint)
    cases = [
        ({1: 3}, "metrics.1", "int"),
        ({"hist": {2: 1}}, "metrics.hist.2", "int"),
        ({"h": {1.5: 1}}, "metrics.h.1.5", "float"),
        ({"h": {b"k": 1}}, "metrics.h.b'k'", "bytes"),
        ({"h": [{True: 1}]}, "metrics.h[0].True", "bool"),
        ({"h": {None: 1}}, "metrics.h.None", "NoneType"),
    ]
    acks = []
    for seq, (metrics, _, _) in enumerate(cases, start=1):
        await sock.send(msgpack.packb({**make_episode(seq, metrics=metrics), "seq": seq}))
        acks.append(msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10)))
    async with Outbox(bp.actor_endpoint, ack_timeout_s=1.0) as out:  # a plain episode still lands after them
        await out.put(make_episode(9, metrics={"delta_f1": 0.25}))
        await out.flush(10)
    sock.close(0)
    ctx.term()

    status, body = bp.http("/records?store=episodes")
    assert status == 200, body
    assert [r["id"] for r in json.loads(body)["items"]] == ["a0:ep0", "a0:ep9"]
    async with BrokerClient(bp.learner_endpoint, timeout_s=5) as client:
        batch = await client.sample("episodes", 10, seed=1)
    assert sorted(r["id"] for r in batch.items) == ["a0:ep0", "a0:ep9"]
    env = {k: v for k, v in os.environ.items() if k not in ("COMAP_OVERRIDES", "COMAP_CONFIG")}
    shown = subprocess.run(
        [sys.executable, "-m", "comap_async", "stats", "--set", f"broker.http_port={bp.http_port}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    for seq, (ack, (_, path, kind)) in enumerate(zip(acks, cases), start=1):
        assert ack["seq"] == seq and not ack["ok"] and ack["retry"] is False, ack
        assert ack["error"] == f"episode: {path}: map keys must be strings, got {kind}", ack
    stats = bp.stats()
    assert stats["stores"]["episodes"]["count"] == 2 and stats["rejects"]["bad_field"] == len(cases)
