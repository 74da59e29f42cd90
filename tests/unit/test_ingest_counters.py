"""The counters a stored record stands for (``broker.ingest.record_counters``) sum, over the records
one message writes, to the counters :meth:`Ingest.prepare` bumps for it; so a fork that cuts records
takes exactly their counts back out of the persisted counters (``ReplayStore.cut_after``)."""

from __future__ import annotations

import msgpack
import pytest

from broker.ingest import Ingest, record_counters
from broker.store import ReplayStore
from comap_async.method.gates import SampleRule
from comap_async.wire.messages import Imagined
from comap_async.wire.protocol import decode, validate
from tests.fixtures.broker import make_episode, make_reflection, make_transition

REFLECTION = make_reflection()
IMAGINED = Imagined(
    seq=1, id="a:e1:2:i0", actor="a", game="g", episode="a:e1", t=2, k=0, goal="g", s="s",
    target="go to desk 1", score=0.8, policy_version=3, wm_version=3, ts=1.0,
)  # fmt: skip


def messages() -> list[tuple[str, dict | Imagined]]:
    return [
        ("warm-up demonstration", make_transition(1, phase="warmup", ws_score=None)),
        ("warm-up recovery", make_transition(2, phase="warmup", ws_score=None, recovery=True)),
        ("warm-up exploration", make_transition(3, phase="warmup", ws_score=None, explore=True)),
        ("co-evolution, kept draft", make_transition(4)),
        ("co-evolution, accepted revision", make_transition(5, decision="REVISE", a_ref="go to fridge 1",
                                                             a_exec="go to fridge 1", p_revise=0.9)),
        ("co-evolution, unscored", make_transition(6, ws_score=None)),
        ("co-evolution, unreadable reflection", make_transition(7, reflection_readable=False)),
        ("suffix-labelled reflection", REFLECTION),
        ("episode", make_episode(4)),
        ("imagined step", IMAGINED),
    ]  # fmt: skip


def ingested(ingest: Ingest, msg: dict | Imagined):
    if isinstance(msg, Imagined):
        return ingest.prepare(msg, b"")
    raw = msgpack.packb({**msg, "seq": 1})
    return ingest.prepare(validate(decode(raw)) if msg["type"] == "reflection" else decode(raw), raw)


@pytest.mark.parametrize("what,msg", messages(), ids=[w for w, _ in messages()])
def test_a_messages_records_stand_for_its_counters(what, msg):
    item = ingested(Ingest(SampleRule()), msg)
    total: dict[str, int] = {}
    for store, value in item.records:
        for k, v in record_counters(store, msgpack.unpackb(value)).items():
            total[k] = total.get(k, 0) + v
    nonzero = lambda d: {k: v for k, v in d.items() if v}  # noqa: E731
    assert nonzero(total) == nonzero(item.counters)


def stamped(msg: dict | Imagined, ts: float, tag: str) -> dict | Imagined:
    """``msg`` with stamp ``ts`` and an id of its own (``tag``)."""
    if isinstance(msg, Imagined):
        return Imagined(**{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "id": msg.id + tag, "ts": ts})
    return {**msg, "id": msg["id"] + tag, "ts": ts}


def test_a_cut_takes_the_cut_records_counts_out(tmp_path):
    """Everything ingested twice, stamped later the second time: a cut between the two leaves the
    counters of the first pass alone (what a fork's ``comap stats`` must show)."""
    ingest = Ingest(SampleRule())
    st = ReplayStore(tmp_path, {s: 100 for s in ("transitions", "reflections", "demos", "episodes", "imagined")})
    try:
        st.write([ingested(ingest, stamped(m, 1.0, "-a")) for _, m in messages()])
        after_first = {k: v for k, v in st.state["counters"].items() if v}
        st.write([ingested(ingest, stamped(m, 50.0, "-b")) for _, m in messages()])
        assert st.state["counters"] != after_first
        removed = st.cut_after(10.0, uncount=record_counters)
        # 3 gated samples (an unreadable reflection derives none) and the suffix-labelled one
        assert removed == {"transitions": 7, "reflections": 4, "demos": 2, "episodes": 1, "imagined": 1}
        assert {k: v for k, v in st.state["counters"].items() if v} == after_first
    finally:
        st.close()
