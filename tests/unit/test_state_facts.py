"""State-level canonical facts (docs/design.md section 11): Delta-F1 and the world-state gate compare the
changes an action makes to the *state*, with worked examples, and the future
context of a reflection sample always describes the draft (point 1)."""

from __future__ import annotations

import pytest

from comap_async.envs import get_next_state
from comap_async.envs.alfworld_facts import next_state, parse_facts
from comap_async.facts import delta_f1, fact_changes, state_delta_f1
from comap_async.method.gates import derive_policy_sample, future_context
from comap_async.wire.protocol import validate
from tests.fixtures.messages import transition

COUNTER = "On the countertop 1, you see a apple 1, and a mug 1."
BEFORE = next_state(frozenset(), COUNTER)


def test_the_state_remembers_what_an_observation_stops_mentioning():
    assert BEFORE == {"at(countertop 1)", "in(apple 1, countertop 1)", "in(mug 1, countertop 1)"}
    after = next_state(BEFORE, "You arrive at cabinet 1. The cabinet 1 is closed.")
    assert after == {"at(cabinet 1)", "closed(cabinet 1)", "in(apple 1, countertop 1)", "in(mug 1, countertop 1)"}
    assert fact_changes(BEFORE, after) == {"+at(cabinet 1)", "-at(countertop 1)", "+closed(cabinet 1)"}


def test_wrong_receptacle_scores_well_below_the_gate():
    """The issue's worked example: arriving at the wrong receptacle. Observation-level facts scored
    it 0.6 (the vanished countertop contents counted as two shared 'changes'); the state keeps
    them, and the shared -at(countertop 1) is the only agreement."""
    real, pred = "You arrive at cabinet 1. The cabinet 1 is closed.", "You arrive at drawer 3. The drawer 3 is closed."
    old = delta_f1(parse_facts(COUNTER), parse_facts(pred), parse_facts(real))
    assert old == pytest.approx(0.6)  # what the observation-level definition said
    score = state_delta_f1(next_state, BEFORE, pred, real)
    assert score == pytest.approx(1 / 3) and score < 0.6


def test_correct_arrival_scores_one():
    real = "You arrive at cabinet 1. The cabinet 1 is closed."
    assert state_delta_f1(next_state, BEFORE, real, real) == 1.0
    # a prediction that says less (only the arrival) gets partial credit: 2 of 3 changes
    assert state_delta_f1(next_state, BEFORE, "You arrive at cabinet 1.", real) == pytest.approx(0.8)


def test_failed_action():
    nothing = "Nothing happens."
    assert next_state(BEFORE, nothing) == BEFORE
    assert state_delta_f1(next_state, BEFORE, nothing, nothing) == 1.0  # no change predicted, none happened
    # predicting a take that the game refused: every predicted change is wrong
    assert state_delta_f1(next_state, BEFORE, "You pick up the apple 1 from the countertop 1.", nothing) == 0.0
    # predicting "Nothing happens." for a take that worked
    assert state_delta_f1(next_state, BEFORE, nothing, "You pick up the apple 1 from the countertop 1.") == 0.0


def test_take_and_put():
    take_apple = "You pick up the apple 1 from the countertop 1."
    held = next_state(BEFORE, take_apple)
    assert fact_changes(BEFORE, held) == {"+holding(apple 1)", "-in(apple 1, countertop 1)"}
    assert state_delta_f1(next_state, BEFORE, take_apple, take_apple) == 1.0
    assert state_delta_f1(next_state, BEFORE, "You pick up the mug 1 from the countertop 1.", take_apple) == 0.0
    # put it elsewhere after walking to the fridge: the state follows the object
    at_fridge = next_state(held, "You arrive at fridge 1. The fridge 1 is open. In it, you see a egg 1.")
    put = "You move the apple 1 to the fridge 1."
    after_put = next_state(at_fridge, put)
    assert fact_changes(at_fridge, after_put) == {"-holding(apple 1)", "+in(apple 1, fridge 1)"}
    assert "in(egg 1, fridge 1)" in after_put and "in(mug 1, countertop 1)" in after_put
    # predicting the put into the wrong receptacle shares the dropped holding(apple 1) only
    wrong = state_delta_f1(next_state, at_fridge, "You move the apple 1 to the countertop 1.", put)
    assert 0.0 < wrong < 0.6


def test_a_listing_replaces_the_remembered_contents():
    later = next_state(BEFORE, "You arrive at countertop 1. On the countertop 1, you see a mug 1.")
    assert "in(apple 1, countertop 1)" not in later and "in(mug 1, countertop 1)" in later
    opened = next_state(
        next_state(BEFORE, "You arrive at drawer 1. The drawer 1 is closed."),
        "You open the drawer 1. The drawer 1 is open. In it, you see nothing.",
    )
    assert {"open(drawer 1)", "empty(drawer 1)"} <= opened and "closed(drawer 1)" not in opened


def test_unreadable_texts():
    assert next_state(BEFORE, "You teleport to the moon.") is None
    assert state_delta_f1(next_state, BEFORE, "You teleport to the moon.", "Nothing happens.") == 0.0
    assert state_delta_f1(next_state, BEFORE, "Nothing happens.", "You teleport to the moon.") is None
    assert get_next_state("alfworld") is next_state


# ------------------------------------------------ point 1: s̄ always describes the draft
DRAFT_IMAGINED = "You arrive at drawer 3. The drawer 3 is closed."
PICK = "You pick up the apple 1 from the countertop 1."


def _step(**over):
    return transition(1, facts=sorted(BEFORE), a_draft="go to drawer 3", s_hat=DRAFT_IMAGINED, **over)


def test_revised_step_shows_the_drafts_future_chosen_by_the_world_state_gate():
    """Revised: the real next state and the executed action's predictions describe the refined
    action, so s̄ describes the draft, and the world-state gate chooses which future of it: the
    student's prediction when it trusts the student, else the draft's real next state that the
    actor took on a branch (``s_next_draft``); a branch that could not be restored leaves none,
    and the sample shows the imagined state."""
    draft_real = "You arrive at drawer 3. The drawer 3 is open. In it, you see a fork 1."
    revised = dict(
        decision="REVISE",
        a_ref="take apple 1 from countertop 1",
        p_revise=0.9,
        q_ref=0.9,
        a_exec="take apple 1 from countertop 1",
        s_hat_exec=PICK,
        s_next=PICK,
    )
    trusted = derive_policy_sample(validate(_step(**revised, s_hat_teacher=PICK, s_next_draft=draft_real)))
    assert trusted.ws_imagined and trusted.s_bar == DRAFT_IMAGINED
    assert trusted.y == 1 and trusted.target == "take apple 1 from countertop 1"
    doubted = derive_policy_sample(
        validate(_step(**revised, s_hat_teacher="Nothing happens.", s_next_draft=draft_real))
    )
    assert not doubted.ws_imagined and doubted.s_bar == draft_real  # the gate applies to revision samples too
    assert doubted.y == 1 and doubted.target == "take apple 1 from countertop 1"
    unmeasured = derive_policy_sample(validate(_step(**revised, s_hat_teacher="Nothing happens.")))
    assert unmeasured.s_bar == DRAFT_IMAGINED
    # the ablations force one future for every step, revised ones included
    real = derive_policy_sample(
        validate(_step(**revised, s_hat_teacher=PICK, s_next_draft=draft_real)), future_state="real"
    )
    assert real.s_bar == draft_real


def test_kept_step_uses_the_gate():
    kept = dict(
        decision="KEEP",
        a_ref="go to drawer 3",
        p_revise=0.1,
        q_ref=0.9,
        a_exec="go to drawer 3",
        s_hat_exec=DRAFT_IMAGINED,
        s_next="You arrive at drawer 3. The drawer 3 is open. In it, you see nothing.",
    )
    agree = derive_policy_sample(validate(_step(**kept, s_hat_teacher=DRAFT_IMAGINED)))
    assert agree.ws_imagined and agree.s_bar == DRAFT_IMAGINED
    disagree = derive_policy_sample(validate(_step(**kept, s_hat_teacher="Nothing happens.")))
    assert not disagree.ws_imagined and disagree.s_bar == kept["s_next"]
    # a refined action that is the draft in other spelling was not a revision
    same = _step(**{**kept, "a_exec": "Go to drawer 3."}, s_hat_teacher=DRAFT_IMAGINED)
    assert future_context(validate(same), True) == DRAFT_IMAGINED
