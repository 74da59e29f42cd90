"""The broker validates every frame through the compiled per-schema check of ``protocol.validate``.

That check is only a fast "yes"; the field-by-field walk still words every reject. These tests
pin the one property that makes this safe: the fast check never accepts a message the walk
would reject, and it does accept ordinary valid messages (so the broker really takes it).
"""

from __future__ import annotations

import math
import random

import pytest

from comap_async.wire import protocol
from comap_async.wire.protocol import SCHEMAS, ProtocolError, make, validate
from tests.fixtures.messages import transition

BAD_VALUES = (None, 1.5, -0.0, "x", "", 7, -(1 << 62) - 1, 1 << 62, [1], [{"a": 1}], {"k": 1}, {1: 2}, True,
              False, b"bytes", "y" * (protocol.TEXT_LEN + 1), "z" * (protocol.ID_LEN + 1), float("nan"),
              float("inf"), "KEEP", "REVISE", "warmup", "demos", 0, 1, 2)


def _walk_accepts(msg: dict) -> bool:
    """The slow definition of valid, field by field (what validate did before the fast path)."""
    schema = SCHEMAS[msg["type"]]
    try:
        for name, spec in schema.items():
            if name in msg:
                protocol._check_value(name, spec, msg[name])
            elif spec.required:
                return False
    except ProtocolError:
        return False
    return all(k in schema or k in ("v", "type") for k in msg)


def _valid_examples() -> list[dict]:
    return [
        transition(3),
        transition(4, expert_action=None, decision="REVISE", phase="warmup", reward=1, p_revise=0),
        make("episode", seq=1, id="a:e", actor="a", env="alfworld", game="g", split="train", phase="coevolve",
             eval=False, steps=7, won=True, reward=1.0, policy_version=2, wm_version=2, wall_s=3.5, ts=1.0,
             metrics={"revision_rate": 0.25}),
        make("reflection", seq=2, id="r", actor="a", game="g", s="s", a_draft="x", s_bar="y", target="z", y=1,
             policy_version=0, wm_version=0, ts=0.0, label="expert_better"),
        make("ack", seq=9, ok=True, error=None, registry=protocol.empty_registry(), retry=False),
        make("sample", req=1, store="demos", n=8, seed=None),
        make("batch", req=1, store="demos", items=[{"s": "x"}], stale_skipped=0, available=1),
        make("announce", req=2, phase="coevolve", versions={"policy": 3}, adapters={"policy": "p"}, step=10),
        make("reply", req=2, ok=False, error="nope", data={}),
    ]


@pytest.mark.parametrize("msg", _valid_examples(), ids=lambda m: m["type"])
def test_fast_check_accepts_valid_messages(msg):
    assert protocol._FAST_CHECKS[msg["type"]](msg)
    assert validate(msg) is msg


def test_fast_check_never_accepts_what_the_walk_rejects():
    rng = random.Random(7)
    cases = 0
    for base in _valid_examples():
        fields = [k for k in base if k not in ("v", "type")]
        for name in fields:
            for bad in BAD_VALUES:
                cases += 1
                m = {**base, name: bad}
                assert protocol._FAST_CHECKS[m["type"]](m) <= _walk_accepts(m), (name, bad)
            m = dict(base)
            del m[name]
            assert protocol._FAST_CHECKS[m["type"]](m) <= _walk_accepts(m), ("missing", name)
        for extra in ("extra", "V", "types"):
            assert not protocol._FAST_CHECKS[base["type"]]({**base, extra: 1})
        for _ in range(200):  # several fields wrong at once
            m = dict(base)
            for name in rng.sample(fields, rng.randint(1, min(4, len(fields)))):
                m[name] = rng.choice(BAD_VALUES)
            cases += 1
            assert protocol._FAST_CHECKS[m["type"]](m) <= _walk_accepts(m), m
    assert cases > 2000


def test_rejects_keep_their_reasons():
    with pytest.raises(ProtocolError, match="field 'p_revise' must be finite"):
        validate({**transition(1), "p_revise": math.nan})
    with pytest.raises(ProtocolError, match="missing field 'o'"):
        validate({k: v for k, v in transition(1).items() if k != "o"})
    with pytest.raises(ProtocolError, match="unknown field 'extra'"):
        validate({**transition(1), "extra": 1})
    with pytest.raises(ProtocolError, match="must be one of"):
        validate({**transition(1), "phase": "later"})
