"""Gate application on ingest, worked examples (docs/design.md section 5), with a small fact parser."""

from __future__ import annotations

import msgpack
import pytest

from broker.ingest import Ingest, record_from_store
from comap_async.method.gates import SampleRule
from comap_async.wire.protocol import decode, validate
from tests.fixtures.broker import make_episode, make_transition


def toy_parser(state: frozenset[str], text: str) -> frozenset[str] | None:
    """The state after ``text`` is the ';'-separated items after 'F:'; anything else is unreadable."""
    if text.startswith("BOOM"):
        raise RuntimeError("parser bug")
    if not text.startswith("F:"):
        return None
    return frozenset(p.strip() for p in text[2:].split(";") if p.strip())


def prepare(tr: dict, ingest: Ingest | None = None):
    ingest = ingest or Ingest(toy_parser, SampleRule())
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
    _, recs, _ = prepare(tr, Ingest(toy_parser, SampleRule(tau_ws=0.9)))
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
    ing = Ingest(toy_parser, SampleRule())
    refl = {
        "v": 1,
        "type": "reflection",
        "seq": 2,
        "id": "r1",
        "actor": "a0",
        "game": "g",
        "s": "s",
        "a_draft": "a",
        "s_bar": "sb",
        "target": "t",
        "y": 1,
        "policy_version": 0,
        "wm_version": 0,
        "ts": 1.0,
        "label": "expert_better",
    }
    item = ing.prepare(validate(refl), b"")
    assert item.dedup_key == b"r:r1" and item.records[0][0] == "reflections"
    assert msgpack.unpackb(item.records[0][1])["source"] == "suffix"
    assert item.counters == {"stored_reflection_msgs": 1, "reflect_label_expert_better": 1}  # shown by comap stats
    ep = {**make_episode(4), "seq": 3}
    item = ing.prepare(validate(ep), b"")
    assert item.dedup_key == b"e:a0:ep4" and item.records[0][0] == "episodes"


def test_parser_exception_counts_and_reads_as_unparseable():
    ing = Ingest(toy_parser, SampleRule())
    tr = make_transition(1, **BASE, s_hat_exec="BOOM", s_hat_teacher="F: at(b)")
    _, recs, _ = prepare(tr, ing)
    assert ing.parser.errors == 1 and "parser bug" in ing.parser.last_error
    assert recs["reflections"]["s_bar"] == tr["s_next"]


def test_identical_predictions_shortcut_gives_the_full_gate_result():
    """When student and teacher predicted the same text the broker only checks readability
    (``next_state.is_readable``); the sample must be the one the full gate gives."""
    from comap_async.envs.alfworld_facts import next_state

    pick = "You pick up the apple 1 from the countertop 1."
    at_counter = ["at(countertop 1)", "in(apple 1, countertop 1)"]
    cases = [  # (state before, student == teacher): readable, empty state, unreadable prediction, no change
        (at_counter, pick),
        ([], pick),
        (at_counter, "You pick up the apple."),
        (at_counter, "Nothing happens."),
    ]
    plain = Ingest(lambda state, text: next_state(state, text), SampleRule())  # no is_readable: full gate
    fast = Ingest(next_state, SampleRule())
    assert plain.parser.readable is None and fast.parser.readable is not None
    for facts, pred in cases:
        tr = make_transition(1, facts=facts, s_hat_exec=pred, s_hat_teacher=pred, s_next=pick)
        _, slow_recs, _ = prepare(tr, plain)
        _, fast_recs, _ = prepare(tr, fast)
        assert fast_recs["reflections"] == slow_recs["reflections"], facts
    assert [
        prepare(make_transition(1, facts=f, s_hat_exec=p, s_hat_teacher=p), fast)[1]["reflections"]["ws_imagined"]
        for f, p in cases
    ] == [True, True, False, True]


def test_readable_check_exception_counts_and_reads_as_unparseable():
    def parser(state, text):
        return toy_parser(state, text)

    def exploding(text):
        raise RuntimeError("readable bug")

    parser.is_readable = exploding
    ing = Ingest(parser, SampleRule())
    tr = make_transition(1, **BASE, s_hat_exec="F: at(b)", s_hat_teacher="F: at(b)")
    _, recs, _ = prepare(tr, ing)
    assert ing.parser.errors >= 1 and "readable bug" in ing.parser.last_error
    assert recs["reflections"]["ws_imagined"] is False and recs["reflections"]["s_bar"] == tr["s_next"]
