"""Gate application on ingest, worked examples (docs/design.md section 5): the world-state score is
what an actor with a small fact parser measures (:func:`world_state_score`), the broker applies it."""

from __future__ import annotations

import msgpack
import pytest

from broker.ingest import Ingest, record_from_store
from comap_async.method.gates import SampleRule, world_state_score
from comap_async.wire.protocol import decode, validate
from tests.fixtures.broker import make_episode, make_reflection, make_transition


def toy_parser(state: frozenset[str], text: str) -> frozenset[str] | None:
    """The state after ``text`` is the ';'-separated items after 'F:'; anything else is unreadable."""
    if text.startswith("BOOM"):
        raise RuntimeError("parser bug")
    if not text.startswith("F:"):
        return None
    return frozenset(p.strip() for p in text[2:].split(";") if p.strip())


def prepare(tr: dict, ingest: Ingest | None = None):
    """``tr`` scored as an actor with :func:`toy_parser` would score it, then ingested."""
    ingest = ingest or Ingest(SampleRule())
    if tr["phase"] != "warmup":
        tr = {
            **tr,
            "ws_score": world_state_score(toy_parser, frozenset(tr["facts"]), tr["s_hat_exec"], tr["s_hat_teacher"]),
        }
    raw = msgpack.packb({**tr, "seq": 1})
    item = ingest.prepare(decode(raw), raw)
    recs = {store: msgpack.unpackb(v) for store, v in item.records}
    return item, recs, raw


# the state before is {at(a)}; the real next state adds holding(x) and drops at(a)
BASE = dict(o="F: at(a)", facts=["at(a)"], s_next="F: at(b); holding(x)")


def test_imagined_state_when_student_and_teacher_agree():
    tr = make_transition(1, **BASE, s_hat_exec="F: at(b); holding(x)", s_hat_teacher="F: at(b); holding(x)")
    item, recs, _ = prepare(tr)
    ref = recs["reflections"]
    assert ref["ws_imagined"] is True and ref["ws_score"] == 1.0 and ref["s_bar"] == tr["s_hat_exec"]
    assert item.counters["gate_ws_imagined"] == 1


def test_real_state_when_student_and_teacher_disagree():
    # student changes {+at(b), -at(a)}, teacher {+holding(x)}: F1 = 0
    tr = make_transition(1, **BASE, s_hat_exec="F: at(b)", s_hat_teacher="F: at(a); holding(x)")
    _, recs, _ = prepare(tr)
    assert recs["reflections"]["ws_imagined"] is False and recs["reflections"]["s_bar"] == tr["s_next"]


def test_partial_agreement_against_threshold():
    # student {+at(b), -at(a), +holding(x)}, teacher {+at(b), -at(a)}: P=2/3, R=1, F1=0.8
    tr = make_transition(1, **BASE, s_hat_exec="F: at(b); holding(x)", s_hat_teacher="F: at(b)")
    _, recs, _ = prepare(tr)
    assert recs["reflections"]["ws_score"] == pytest.approx(0.8) and recs["reflections"]["ws_imagined"]
    _, recs, _ = prepare(tr, Ingest(SampleRule(tau_ws=0.9)))
    assert not recs["reflections"]["ws_imagined"] and recs["reflections"]["s_bar"] == tr["s_next"]


def test_unparseable_prediction_uses_the_real_state():
    tr = make_transition(1, **BASE, s_hat_exec="I think you hold it", s_hat_teacher="F: at(b)")
    _, recs, _ = prepare(tr)
    assert recs["reflections"]["ws_score"] == 0.0 and recs["reflections"]["s_bar"] == tr["s_next"]


@pytest.mark.parametrize(
    "p,q,a_ref,accepted,reason",
    [
        (0.9, 0.8, "open fridge 1", True, "revised"),
        (0.5, 0.9, "open fridge 1", False, "keep"),  # p must be strictly above 0.5
        (0.9, 0.6, "open fridge 1", False, "low_confidence"),  # q must be strictly above 0.6
        (0.9, 0.9, "Take apple 1 from countertop 1.", False, "same_action"),  # canonically the draft
    ],
)
def test_action_gate_sets_target_and_label(p, q, a_ref, accepted, reason):
    tr = make_transition(
        1,
        decision="REVISE",
        p_revise=p,
        q_ref=q,
        a_ref=a_ref,
        a_exec=a_ref if accepted else "take apple 1 from countertop 1",
    )
    item, recs, _ = prepare(tr)
    ref = recs["reflections"]
    assert ref["ag_reason"] == reason
    if accepted:
        assert ref["target"] == a_ref and ref["y"] == 1
    else:
        assert ref["target"] == tr["a_draft"] and ref["y"] == 0
    assert item.counters["gate_ag_open"] == int(accepted) and item.counters[f"gate_ag_{reason}"] == 1


def test_warmup_goes_to_demos_and_transitions_without_reflection():
    tr = make_transition(3, phase="warmup", expert_action="go to fridge 1", a_exec="go to fridge 1")
    item, recs, raw = prepare(tr)
    assert set(recs) == {"transitions", "demos"} and item.dedup_key == b"t:a0:ep0:3"
    assert recs["demos"]["target"] == "go to fridge 1" and recs["demos"]["s"] == tr["s"]
    assert dict(item.records)["transitions"] == raw  # the exact bytes received
    served = record_from_store("transitions", raw)
    assert "seq" not in served and "v" not in served and served["id"] == tr["id"]


def test_warmup_without_expert_field_uses_the_executed_action():
    tr = make_transition(3, phase="warmup", expert_action=None, a_exec="go to sink 1")
    _, recs, _ = prepare(tr)
    assert recs["demos"]["target"] == "go to sink 1"


def test_reflection_and_episode_messages():
    ing = Ingest(SampleRule())
    refl = {**make_reflection(), "seq": 2}
    item = ing.prepare(validate(refl), b"")
    assert item.dedup_key == b"r:r1" and item.records[0][0] == "reflections"
    assert msgpack.unpackb(item.records[0][1])["source"] == "suffix"
    assert item.counters == {"stored_reflection_msgs": 1, "reflect_label_expert_better": 1}  # shown by comap stats
    ep = {**make_episode(4), "seq": 3}
    item = ing.prepare(validate(ep), b"")
    assert item.dedup_key == b"e:a0:ep4" and item.records[0][0] == "episodes"


def test_a_transition_without_a_score_is_never_trusted_and_counted():
    """An actor that measured no reliability (``ws_score`` None): the real next state, and the
    broker's counters say so (``gate_ws_unscored``)."""
    tr = make_transition(1, **BASE, s_hat_exec="F: at(b); holding(x)", s_hat_teacher="F: at(b); holding(x)")
    tr.pop("ws_score", None)
    raw = msgpack.packb({**tr, "seq": 1})
    item = Ingest(SampleRule()).prepare(decode(raw), raw)
    ref = msgpack.unpackb(dict(item.records)["reflections"])
    assert ref["ws_imagined"] is False and ref["ws_score"] == 0.0 and ref["s_bar"] == tr["s_next"]
    assert item.counters["gate_ws_unscored"] == 1


def test_the_score_decides_against_the_brokers_threshold():
    tr = make_transition(1, **BASE, ws_score=0.6)
    raw = msgpack.packb({**tr, "seq": 1})
    for tau, trusted in ((0.6, True), (0.61, False)):
        item = Ingest(SampleRule(tau_ws=tau)).prepare(decode(raw), raw)
        assert msgpack.unpackb(dict(item.records)["reflections"])["ws_imagined"] is trusted
        assert "gate_ws_unscored" not in item.counters


def test_identical_predictions_shortcut_gives_the_full_score():
    """When student and teacher predicted the same text the actor only checks readability
    (``next_state.is_readable``); the score must be the one the full comparison gives."""
    from comap_async.envs.alfworld_facts import next_state

    pick = "You pick up the apple 1 from the countertop 1."
    at_counter = frozenset(["at(countertop 1)", "in(apple 1, countertop 1)"])
    cases = [  # (state before, student == teacher): readable, empty state, unreadable prediction, no change
        (at_counter, pick),
        (frozenset(), pick),
        (at_counter, "You pick up the apple."),
        (at_counter, "Nothing happens."),
    ]
    plain = lambda state, text: next_state(state, text)  # noqa: E731 - no is_readable: the full comparison
    assert getattr(next_state, "is_readable", None) is not None
    scores = [world_state_score(next_state, before, pred, pred) for before, pred in cases]
    assert scores == [world_state_score(plain, before, pred, pred) for before, pred in cases]
    assert scores == [1.0, 1.0, 0.0, 1.0]


def test_the_broker_imports_no_environment_fact_parser():
    """The broker stores and samples typed records: no module of ``broker/`` imports an environment
    package or the fact parsing (the world-state score arrives measured by the actor)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "broker"
    offending = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith(("comap_async.envs", "comap_async.facts")) or name.endswith("_facts"):
                    offending.append(f"{path.name}:{node.lineno} {name}")
    assert not offending, offending
