"""Worked examples for both gates and Delta-F1."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comap_async.facts import NO_CHANGE, changes_f1, delta_f1, fact_changes, set_f1
from comap_async.method.gates import (
    action_gate,
    canonical_action,
    derive_policy_sample,
    world_state_gate,
    world_state_gate_on_facts,
    world_state_score,
)
from comap_async.wire.protocol import validate
from tests.fixtures.messages import transition as _transition

PREV = frozenset({"at(countertop 1)", "in(apple 1, countertop 1)"})
REAL = frozenset({"at(countertop 1)", "holding(apple 1)"})  # picked the apple up


# ------------------------------------------------------------------ Delta-F1
def test_delta_f1_agreement_is_one():
    assert delta_f1(PREV, REAL, REAL) == 1.0


def test_delta_f1_disagreement_is_partial():
    # predicted: the apple left the countertop, but nothing says it is held (1 of 2 changes right)
    pred = frozenset({"at(countertop 1)"})
    assert fact_changes(PREV, pred) == {"-in(apple 1, countertop 1)"}
    assert delta_f1(PREV, pred, REAL) == pytest.approx(2 * 1.0 * 0.5 / 1.5)


def test_delta_f1_total_disagreement_is_zero():
    pred = frozenset({"at(fridge 1)", "in(apple 1, countertop 1)"})
    assert delta_f1(PREV, pred, REAL) == 0.0


def test_delta_f1_empty_changes():
    # "Nothing happens." predicted and real: both change sets empty -> perfect agreement
    assert delta_f1(PREV, PREV, PREV) == 1.0
    # predicted no change but something changed -> 0; predicted a change that did not happen -> 0
    assert delta_f1(PREV, PREV, REAL) == 0.0
    assert delta_f1(PREV, REAL, PREV) == 0.0


def test_delta_f1_unparseable_prediction_is_zero():
    assert delta_f1(PREV, None, REAL) == 0.0
    with pytest.raises(ValueError):
        delta_f1(None, REAL, REAL)


def test_set_f1_symmetry_and_bounds():
    a, b = {"+x", "+y", "-z"}, {"+x", "-z", "+w", "+v"}
    assert set_f1(a, b) == set_f1(b, a) == pytest.approx(2 * 2 / (3 + 4))


# ------------------------------------------------------------------ action gate
@pytest.mark.parametrize(
    "p, q, a_ref, a_draft, expected",
    [
        (0.9, 0.9, "open fridge 1", "go to fridge 1", (True, "revised")),
        (0.5, 0.9, "open fridge 1", "go to fridge 1", (False, "keep")),  # strictly greater than tau_p
        (0.9, 0.6, "open fridge 1", "go to fridge 1", (False, "low_confidence")),  # strictly greater than tau_q
        (0.9, 0.9, "Go to  Fridge 1.", "go to fridge 1", (False, "same_action")),  # canonically equal
        (0.9, 0.9, "  ", "go to fridge 1", (False, "same_action")),
        (0.1, 0.1, "open fridge 1", "go to fridge 1", (False, "keep")),
    ],
)
def test_action_gate(p, q, a_ref, a_draft, expected):
    r = action_gate(p, q, a_ref, a_draft, tau_p=0.5, tau_q=0.6)
    assert (r.open, r.reason) == expected


def test_canonical_action():
    assert canonical_action(' "Take Apple 1 from  countertop 1." ') == "take apple 1 from countertop 1"


# ------------------------------------------------------------------ world-state gate
def test_world_state_gate_agreement_and_threshold():
    s = fact_changes(PREV, REAL)
    assert world_state_gate(s, s, 0.6) == (True, 1.0)
    partial = frozenset({"-in(apple 1, countertop 1)"})  # F1 = 2/3 with s
    r = world_state_gate(partial, s, 0.6)
    assert r.use_imagined and r.score == pytest.approx(2 / 3)
    assert not world_state_gate(partial, s, 0.7).use_imagined
    assert world_state_gate(frozenset({"+at(fridge 1)"}), s, 0.6) == (False, 0.0)


def test_world_state_gate_empty_and_unparseable():
    assert world_state_gate(frozenset(), frozenset(), 0.6).use_imagined  # both say "nothing changes"
    assert world_state_gate(None, frozenset(), 0.6) == (False, 0.0)
    assert world_state_gate(frozenset(), None, 0.6) == (False, 0.0)


# ------------------------------------------------------------------ derived sample
_FACTS = {
    "O": PREV,
    "PICKED": REAL,
    "FRIDGE": frozenset({"at(fridge 1)", "in(apple 1, countertop 1)"}),
}


def _parse(state: frozenset[str], text: str):
    return _FACTS.get(text)  # the state after each text, whatever it was; unknown text is unparseable


def transition(*args, **over):
    """A transition scored as an actor with :func:`_parse` scores it (``ws_score``)."""
    msg = _transition(*args, **over)
    msg["ws_score"] = world_state_score(_parse, frozenset(msg["facts"]), msg["s_hat_exec"], msg["s_hat_teacher"])
    return msg


def test_derived_sample_imagined_state_and_accepted_revision():
    # the revised step: s_bar is the student's prediction for the *draft* (docs/design.md section 5)
    # when the gate, which scores the executed action's predictions, trusts the student
    tr = transition(
        1,
        o="O",
        s_hat="DRAFT IMAGINED",
        s_hat_exec="PICKED",
        s_hat_teacher="PICKED",
        s_next="REAL NEXT",
        a_draft="go to fridge 1",
        a_ref="take apple 1 from countertop 1",
        decision="REVISE",
        p_revise=0.8,
        q_ref=0.7,
        a_exec="take apple 1 from countertop 1",
        facts=sorted(PREV),
    )
    d = derive_policy_sample(validate(tr))
    assert d.s_bar == "DRAFT IMAGINED" and d.ws_imagined and d.ws_score == 1.0
    assert d.target == "take apple 1 from countertop 1" and d.y == 1
    t = validate(tr).ts
    assert d.ts == t > 0  # the transition's stamp: a fork's cut keeps it only up to the fork point


def test_derived_sample_real_state_and_kept_draft():
    tr = transition(
        1,
        o="O",
        s_hat_exec="PICKED",
        s_hat_teacher="FRIDGE",
        s_next="REAL NEXT",
        a_draft="go to fridge 1",
        a_ref="take apple 1 from countertop 1",
        decision="REVISE",
        p_revise=0.8,
        q_ref=0.5,
        a_exec="go to fridge 1",
        facts=sorted(PREV),
    )
    d = derive_policy_sample(validate(tr))
    assert d.s_bar == "REAL NEXT" and not d.ws_imagined
    assert d.target == "go to fridge 1" and d.y == 0 and d.ag_reason == "low_confidence"


def test_derived_sample_unparseable_student_uses_real_state():
    tr = transition(1, o="O", s_hat_exec="gibberish", s_hat_teacher="PICKED", s_next="REAL NEXT", facts=sorted(PREV))
    d = derive_policy_sample(validate(tr))
    assert d.s_bar == "REAL NEXT" and d.ws_score == 0.0


_FACT_POOL = [
    "at(a 1)",
    "at(b 1)",
    "holding(x 1)",
    "holding(nothing)",
    "in(x 1, b 1)",
    "in(y 1, b 1)",
    "open(b 1)",
    "closed(b 1)",
    "hot(x 1)",
    NO_CHANGE,
]


@settings(max_examples=3000, deadline=None)
@given(
    st.frozensets(st.sampled_from(_FACT_POOL)),
    st.frozensets(st.sampled_from(_FACT_POOL)),
    st.frozensets(st.sampled_from(_FACT_POOL)),
)
def test_changes_f1_equals_f1_of_the_change_sets(before, a, b):
    """The broker's fast path gives exactly (bit for bit) the reference definition's score."""
    assert changes_f1(before, a, b) == set_f1(fact_changes(before, a), fact_changes(before, b))


def test_world_state_gate_on_facts_matches_the_gate_on_changes():
    prev = frozenset({"at(a 1)", "in(x 1, a 1)"})
    student = frozenset({"at(a 1)", "holding(x 1)"})
    teacher = frozenset({"at(a 1)", "holding(x 1)", "open(a 1)"})
    ref = world_state_gate(fact_changes(prev, student), fact_changes(prev, teacher), 0.6)
    assert world_state_gate_on_facts(prev, student, teacher, 0.6) == ref
    assert world_state_gate_on_facts(None, student, teacher).use_imagined is False
    assert world_state_gate_on_facts(prev, student, None) == (False, 0.0)


# ------------------------------------------------------------------ ablations of the world-state gate
def _kept_step(teacher: str):
    return validate(
        transition(
            1,
            o="O",
            s_hat_exec="PICKED",
            s_hat_teacher=teacher,
            s_next="REAL NEXT",
            a_draft="take apple 1 from countertop 1",
            a_exec="take apple 1 from countertop 1",
            facts=sorted(PREV),
        )
    )


@pytest.mark.parametrize("teacher, gate_picks", [("PICKED", "PICKED"), ("FRIDGE", "REAL NEXT")])
def test_ws_gate_ablations_fix_the_future_state(teacher, gate_picks):
    """``no_ws_gate_real`` / ``no_ws_gate_imagined``: s̄ is the real / the imagined next
    state whatever the gate says; the gate's own score is still computed and kept."""
    tr = _kept_step(teacher)
    gated = derive_policy_sample(tr)
    assert gated.s_bar == gate_picks
    for future_state, s_bar in (("real", "REAL NEXT"), ("imagined", "PICKED")):
        d = derive_policy_sample(tr, future_state=future_state)
        assert d.s_bar == s_bar, future_state
        assert (d.ws_score, d.ws_imagined, d.target, d.y) == (gated.ws_score, gated.ws_imagined, gated.target, gated.y)
    with pytest.raises(ValueError, match="future_state"):
        derive_policy_sample(tr, future_state="teacher")


def test_no_action_gate_reads_every_real_revision_as_executed():
    """The ablation ``no_action_gate`` at the broker: the policy sample's target is the executed
    reflected action even where the gate would have refused it (low q_ref here)."""
    tr = validate(
        transition(
            1,
            o="O",
            s_hat_exec="PICKED",
            s_hat_teacher="PICKED",
            s_next="REAL NEXT",
            a_draft="go to fridge 1",
            a_ref="take apple 1 from countertop 1",
            decision="REVISE",
            p_revise=0.3,
            q_ref=0.1,
            a_exec="take apple 1 from countertop 1",
            facts=sorted(PREV),
        )
    )
    gated = derive_policy_sample(tr)
    assert (gated.y, gated.ag_reason) == (0, "keep")
    d = derive_policy_sample(tr, action_gated=False)
    assert (d.target, d.y, d.ag_reason) == ("take apple 1 from countertop 1", 1, "revised")
    same = validate(transition(1, a_ref="Go to fridge 1.", a_draft="go to fridge 1", a_exec="go to fridge 1"))
    assert derive_policy_sample(same, action_gated=False).y == 0  # the same action is no revision
