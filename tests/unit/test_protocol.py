"""The decoder turns any bytes into a valid message or ProtocolError."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comap_async.wire import protocol
from comap_async.wire.protocol import ProtocolError, as_map, decode, encode, make
from tests.fixtures.messages import transition

N_FUZZ = 12_000


def _valid_messages() -> list[dict]:
    """Wire maps of every message type."""
    return [
        as_map(m) if not isinstance(m, dict) else m
        for m in [
            transition(3),
            transition(4, expert_action=None, decision="REVISE", phase="warmup"),
            make(
                "episode",
                seq=1,
                id="a:e",
                actor="a",
                env="alfworld",
                game="g",
                split="train",
                phase="coevolve",
                eval=False,
                steps=7,
                won=True,
                reward=1.0,
                policy_version=2,
                wm_version=2,
                wall_s=3.5,
                ts=1.0,
                metrics={"revision_rate": 0.25},
            ),
            make(
                "reflection",
                seq=2,
                id="r",
                actor="a",
                game="g",
                s="s",
                a_draft="x",
                s_bar="y",
                target="z",
                y=1,
                policy_version=0,
                wm_version=0,
                ts=0.0,
                label="expert_better",
            ),
            make("ack", seq=9, ok=True, error=None, registry=protocol.empty_registry()),
            make("sample", req=1, store="demos", n=8, seed=3),
            make("batch", req=1, store="demos", items=[{"s": "x", "target": "y"}], stale_skipped=0, available=1),
            make(
                "announce", req=2, phase="coevolve", versions={"policy": 3}, adapters={"policy": "policy-v3"}, step=10
            ),
            make("reply", req=2, ok=False, error="nope", data={}),
        ]
    ]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and b:  # flip bits
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1:  # truncate
        b = b[: rng.randrange(len(b) + 1)]
    elif op == 2:  # insert junk
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif op == 3:  # duplicate a slice
        i = rng.randrange(len(b) + 1)
        b += b[i : i + rng.randint(1, 32)]
    elif op == 4 and b:  # overwrite a byte with a msgpack type marker
        b[rng.randrange(len(b))] = rng.choice([0xC0, 0xC1, 0xC4, 0xD9, 0xDC, 0xDE, 0xDF, 0xCB, 0x80, 0x90])
    else:  # append trailing data
        b += rng.randbytes(rng.randint(1, 8))
    return bytes(b)


def _semantic_mutations() -> list[bytes]:
    """Well-formed msgpack that violates the schema: wrong types, huge strings, versions, keys."""
    base = transition(1)
    out = []
    for key in list(base):
        for bad in (None, 1.5, "x", 7, [1], {"k": 1}, True, b"bytes", "y" * (protocol.TEXT_LEN + 1)):
            m = dict(base)
            m[key] = bad
            out.append(msgpack.packb(m, use_bin_type=True))
        m = dict(base)
        del m[key]
        out.append(msgpack.packb(m, use_bin_type=True))
    for v in (0, 2, -1, "1", None, 1.0):
        out.append(msgpack.packb({**base, "v": v}))
    out.append(msgpack.packb({**base, "extra": 1}))
    out.append(msgpack.packb({1: 2}))
    out.append(msgpack.packb([base]))
    out.append(msgpack.packb({**base, "p_revise": float("nan")}))
    out.append(msgpack.packb({**base, "t": 1 << 63}))
    return out


def test_fuzz_decoder_only_raises_protocol_error():
    rng = random.Random(1234)
    valid = [encode(m) for m in _valid_messages()]
    inputs: list[bytes] = _semantic_mutations()
    while len(inputs) < N_FUZZ:
        kind = rng.random()
        if kind < 0.25:
            inputs.append(rng.randbytes(rng.randint(0, 256)))
        else:
            inputs.append(_mutate(rng.choice(valid), rng))
    assert len(inputs) >= 10_000
    rejected = accepted = 0
    for data in inputs:
        try:
            msg = decode(data)
        except ProtocolError as exc:
            assert str(exc), "a ProtocolError must carry a reason"
            rejected += 1
        else:  # a mutation can still be valid; then it must re-encode to an equal message
            assert decode(encode(msg)) == msg
            accepted += 1
    assert rejected > 0.9 * len(inputs)


def test_non_bytes_and_limits_raise_protocol_error():
    for bad in (None, "text", 3, [b"x"]):
        with pytest.raises(ProtocolError):
            decode(bad)
    with pytest.raises(ProtocolError, match="limit"):
        decode(encode(transition(1)), max_bytes=100)
    with pytest.raises(ProtocolError, match="empty"):
        decode(b"")


@pytest.mark.parametrize("msg", _valid_messages(), ids=lambda m: m["type"])
def test_valid_messages_round_trip(msg):
    assert as_map(decode(encode(msg))) == msg


text = st.text(max_size=200)


@settings(max_examples=300, deadline=None)
@given(
    s=text,
    a=text,
    p=st.floats(0, 1),
    q=st.floats(0, 1),
    t=st.integers(0, 10_000),
    expert=st.one_of(st.none(), text),
    done=st.booleans(),
)
def test_property_transitions_round_trip(s, a, p, q, t, expert, done):
    msg = transition(t, s=s, a_draft=a, p_revise=p, q_ref=q, expert_action=expert, done=done)
    assert as_map(decode(encode(msg))) == msg


def test_validation_reasons_name_the_field():
    m = dict(transition(1))
    m["p_revise"] = "high"
    with pytest.raises(ProtocolError, match="p_revise"):
        decode(msgpack.packb(m))
    m = dict(transition(1))
    del m["s_next"]
    with pytest.raises(ProtocolError, match="s_next"):
        decode(msgpack.packb(m))
    with pytest.raises(ProtocolError, match="schema version"):
        decode(msgpack.packb({**transition(1), "v": 99}))


@pytest.mark.parametrize(
    "mtype, field, value, reason",
    [
        ("episode", "metrics", {1: 3}, "metrics.1: map keys must be strings, got int"),
        ("episode", "metrics", {"hist": {2: 1}}, "metrics.hist.2: map keys must be strings, got int"),
        ("episode", "metrics", {"h": [{b"k": 1}]}, "metrics.h[0].b'k': map keys must be strings, got bytes"),
        (
            "eval_result",
            "result",
            {"per_game": {None: 0.5}},
            "result.per_game.None: map keys must be strings, got NoneType",
        ),
        ("announce", "metrics", {"h": {1.5: 1, True: 2}}, "metrics.h.1.5: map keys must be strings, got float"),
    ],
)
def test_map_keys_that_are_not_strings_are_refused_naming_the_path(mtype, field, value, reason):
    """The broker's stores read maps back with string keys only (as JSON has): a message whose free-form
    map holds another key is refused by both the decoder and ``validate``, in one line."""
    base = {
        "episode": as_map(_valid_messages()[2]),
        "eval_result": {"v": 1, "type": "eval_result", "req": 1, "version": 1, "result": {}},
        "announce": {
            "v": 1,
            "type": "announce",
            "req": 1,
            "phase": "warmup",
            "versions": {},
            "adapters": {},
            "step": 0,
        },
    }[mtype]
    assert base["type"] == mtype
    m = {**base, field: value}
    for check in (lambda: decode(msgpack.packb(m)), lambda: protocol.validate(m)):
        with pytest.raises(ProtocolError) as exc:
            check()
        assert str(exc.value) == f"{mtype}: {reason}"
