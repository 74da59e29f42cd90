"""The broker validates every frame by decoding it into the typed messages (msgspec, one pass).

The frozen version-1 validator (``tests/fixtures/protocol_v1.py``) is the specification: the
typed decoder must never accept a message it refused (so an older peer reads every frame this
side accepts and sends), and it must accept ordinary valid messages.
"""

from __future__ import annotations

import math
import random

import msgpack
import pytest

from comap_async.wire import protocol
from comap_async.wire.protocol import ProtocolError, as_map, decode, make, validate
from tests.fixtures import protocol_v1
from tests.fixtures.messages import transition

BAD_VALUES = (
    None,
    1.5,
    -0.0,
    "x",
    "",
    7,
    -(1 << 62) - 1,
    1 << 62,
    [1],
    [{"a": 1}],
    {"k": 1},
    {1: 2},
    True,
    False,
    b"bytes",
    "y" * (protocol.TEXT_LEN + 1),
    "z" * (protocol.ID_LEN + 1),
    float("nan"),
    float("inf"),
    "KEEP",
    "REVISE",
    "warmup",
    "demos",
    0,
    1,
    2,
)


def _valid_examples() -> list[dict]:
    return [
        as_map(m) if not isinstance(m, dict) else m
        for m in [
            transition(3),
            transition(4, expert_action=None, decision="REVISE", phase="warmup", reward=1, p_revise=0),
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
            make("ack", seq=9, ok=True, error=None, registry=as_map(protocol.empty_registry()), retry=False),
            make("sample", req=1, store="demos", n=8, seed=None),
            make("batch", req=1, store="demos", items=[{"s": "x"}], stale_skipped=0, available=1),
            make("announce", req=2, phase="coevolve", versions={"policy": 3}, adapters={"policy": "p"}, step=10),
            make("reply", req=2, ok=False, error="nope", data={}),
        ]
    ]


def _typed_accepts(msg: dict) -> bool:
    try:
        decode(msgpack.packb(msg, use_bin_type=True))
    except ProtocolError:
        return False
    return True


@pytest.mark.parametrize("msg", _valid_examples(), ids=lambda m: m["type"])
def test_valid_messages_pass_both_validators(msg):
    assert protocol_v1.accepts(msg)
    assert as_map(validate(msg)) == msg
    assert _typed_accepts(msg)


def test_the_typed_decoder_never_accepts_what_version_1_refused():
    rng = random.Random(7)
    cases = refused = 0
    for base in _valid_examples():
        fields = [k for k in base if k not in ("v", "type")]
        for name in fields:
            for bad in BAD_VALUES:
                cases += 1
                m = {**base, name: bad}
                if not protocol_v1.accepts(m):
                    refused += 1
                    assert not _typed_accepts(m), (base["type"], name, bad)
            m = dict(base)
            del m[name]
            assert _typed_accepts(m) <= protocol_v1.accepts(m), ("missing", name)
        for extra in ("extra", "V", "types"):
            assert not _typed_accepts({**base, extra: 1})
        for _ in range(200):  # several fields wrong at once
            m = dict(base)
            for name in rng.sample(fields, rng.randint(1, min(4, len(fields)))):
                m[name] = rng.choice(BAD_VALUES)
            cases += 1
            assert _typed_accepts(m) <= protocol_v1.accepts(m), m
    assert cases > 2000 and refused > 1000


def test_what_the_typed_messages_send_version_1_reads():
    """Every message built with defaults (optional fields filled in) is a valid version-1 map."""
    for m in _valid_examples():
        assert protocol_v1.accepts(msgpack.unpackb(protocol.encode(m), raw=False))


def test_rejects_keep_their_reasons():
    with pytest.raises(ProtocolError, match="field 'p_revise' must be finite"):
        validate({**transition(1), "p_revise": math.nan})
    with pytest.raises(ProtocolError, match="missing field 'o'"):
        validate({k: v for k, v in transition(1).items() if k != "o"})
    with pytest.raises(ProtocolError, match="unknown field 'extra'"):
        validate({**transition(1), "extra": 1})
    with pytest.raises(ProtocolError, match="must be one of"):
        validate({**transition(1), "phase": "later"})
