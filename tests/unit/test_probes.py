"""Held-out probes on hand-made transitions: pure scoring and summaries."""

from __future__ import annotations

import pytest

from comap_async.envs.alfworld_facts import next_state
from comap_async.facts import state_delta_f1
from evaluator.probes import ProbeRow, draft_scores, probe_line, summarize_probes

ADMISSIBLE = ("go to fridge 1", "take apple 1 from countertop 1", "look", "inventory")


def test_draft_scores():
    assert draft_scores("take apple 1 from countertop 1", "take apple 1 from countertop 1", ADMISSIBLE) == (True, True)
    assert draft_scores("Take apple 1 from countertop 1.", "take apple 1 from countertop 1", ADMISSIBLE) == (True, True)
    assert draft_scores("go to fridge 1", "take apple 1 from countertop 1", ADMISSIBLE) == (False, True)
    assert draft_scores("fly to the moon", "look", ADMISSIBLE) == (False, False)
    assert draft_scores(None, "look", ADMISSIBLE) == (False, False)


def test_summary_of_hand_made_transitions():
    before = next_state(frozenset(), "On the countertop 1, you see a apple 1, and a mug 1.")
    real = "You arrive at cabinet 1. The cabinet 1 is closed."
    rows = [
        # right prediction, right draft
        ProbeRow("g1", 0, "walkthrough", state_delta_f1(next_state, before, real, real), True, True),
        # the wrong receptacle (1/3), an admissible but wrong draft
        ProbeRow(
            "g1",
            1,
            "walkthrough",
            state_delta_f1(next_state, before, "You arrive at drawer 3. The drawer 3 is closed.", real),
            False,
            True,
        ),
        # a failure transition predicted as a success (0)
        ProbeRow(
            "g1",
            1,
            "failure",
            state_delta_f1(next_state, before, "You pick up the apple 1 from the countertop 1.", "Nothing happens."),
        ),
        # unreadable real observation: not scored; an inadmissible draft
        ProbeRow("g2", 0, "walkthrough", None, False, False),
    ]
    s = summarize_probes(rows)
    assert s["wm_delta_f1"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert s["wm_delta_f1_walkthrough"] == pytest.approx((1 + 1 / 3) / 2) and s["wm_delta_f1_failures"] == 0.0
    assert s["draft_accuracy"] == pytest.approx(1 / 3) and s["admissible_rate"] == pytest.approx(2 / 3)
    assert (s["walkthrough_states"], s["failure_transitions"], s["wm_scored"], s["games"]) == (3, 1, 3, 2)
    assert probe_line(s) == (
        "wm_delta_f1=0.4444 draft_accuracy=0.3333 executed_accuracy=n/a admissible_rate=0.6667 "
        "reflection_problem_rate=n/a gate_open_rate=n/a p_discrimination=n/a"
    )


def test_empty_probes_say_n_a():
    s = summarize_probes([])
    assert s["wm_delta_f1"] is None and probe_line(s) == (
        "wm_delta_f1=n/a draft_accuracy=n/a executed_accuracy=n/a admissible_rate=n/a reflection_problem_rate=n/a "
        "gate_open_rate=n/a p_discrimination=n/a"
    )


def test_reflection_figures_of_hand_made_rows():
    def row(t, match, p, problem, reason):
        return ProbeRow("g", t, "walkthrough", 1.0, match, True, p, problem, reason)

    rows = [
        row(0, True, 0.2, False, "keep"),
        row(1, True, 0.4, True, "keep"),
        row(2, False, 0.9, False, "revised"),
        row(3, False, 0.7, False, "low_confidence"),
        row(4, False, None, True, "unreadable"),
        ProbeRow("g", 5, "walkthrough", 1.0, False, False),
    ]  # no draft: nothing to reflect on
    s = summarize_probes(rows)
    assert s["reflections"] == 5 and s["gate_reasons"] == {
        "keep": 2,
        "revised": 1,
        "low_confidence": 1,
        "unreadable": 1,
    }
    assert s["reflection_problem_rate"] == pytest.approx(2 / 5) and s["unreadable_rate"] == pytest.approx(1 / 5)
    assert s["gate_open_rate"] == pytest.approx(1 / 5)
    # wrong drafts: mean p 0.8 (the unreadable one has none), right drafts 0.3
    assert s["p_wrong_draft"] == pytest.approx(0.8) and s["p_right_draft"] == pytest.approx(0.3)
    assert s["p_discrimination"] == pytest.approx(0.5)
    assert "p_discrimination=0.5000" in probe_line(s)
    assert summarize_probes(rows[4:])["p_discrimination"] is None  # needs both kinds of drafts
    # the wrong drafts split by whether the game would accept them: the 0.7 one is inadmissible here
    refused = ProbeRow("g", 3, "walkthrough", 1.0, False, False, 0.7, False, "low_confidence")
    s = summarize_probes([*rows[:3], refused])
    assert (s["p_wrong_inadmissible"], s["p_wrong_admissible"]) == (pytest.approx(0.7), pytest.approx(0.9))
    assert s["p_states"] == {"right": 2, "wrong_inadmissible": 1, "wrong_admissible": 1}


def test_what_the_gates_openings_did_to_the_executed_action():
    def row(t, match, reason, executed):
        return ProbeRow("g", t, "walkthrough", 1.0, match, True, 0.9, False, reason, executed_match=executed)

    rows = [
        row(0, True, "keep", True),
        row(1, False, "revised", True),  # a wrong draft revised to the expert's action
        row(2, True, "revised", False),  # a right draft revised away
        row(3, False, "revised", False),  # a wrong draft revised to another wrong one
        row(4, False, "same_action", False),
        ProbeRow("g", 5, "walkthrough", 1.0, False, False),  # no draft: no step
    ]
    s = summarize_probes(rows)
    assert s["draft_accuracy"] == pytest.approx(2 / 6) and s["executed_accuracy"] == pytest.approx(2 / 5)
    assert (s["revisions_fixed"], s["revisions_broke"]) == (1, 1)
    assert "executed_accuracy=0.4000" in probe_line(s)


def test_the_rank_figures_of_p_and_of_the_drafts_confidence():
    def row(t, match, p, confidence):
        return ProbeRow("g", t, "walkthrough", 1.0, match, True, p, False, "keep", confidence)

    # of the 4 (wrong, right) pairs p ranks 1 the right way (0.5 over 0.2) and ties 1: AUC 1.5 / 4
    rows = [row(0, True, 0.5, 0.95), row(1, True, 0.2, 0.7), row(2, False, 0.5, 0.3), row(3, False, 0.1, None)]
    s = summarize_probes(rows)
    assert s["p_auc"] == pytest.approx(1.5 / 4)
    # the confidence shown: lower on the wrong draft (0.3) than on both right ones: doubt ranks it first
    assert s["confidence_wrong_draft"] == pytest.approx(0.3) and s["confidence_right_draft"] == pytest.approx(0.825)
    assert s["confidence_auc"] == 1.0
    plain = summarize_probes([row(0, True, 0.5, None), row(2, False, 0.5, None)])  # the switch off
    assert plain["confidence_auc"] is None and plain["confidence_wrong_draft"] is None and plain["p_auc"] == 0.5


class ScriptedStep:
    """The model calls of one CoMap step, answered from a script: a wrong draft, and a reflection that
    revises it to ``a_ref`` with ``p`` and ``q`` over the paper's thresholds (the gate opens)."""

    def __init__(self, draft: str, a_ref: str) -> None:
        self.draft, self.a_ref = draft, a_ref

    async def draft_scored(self, seen, admissible=None):
        from actors.llm import Draft

        return Draft(self.draft, None, 0.6)

    async def imagine(self, s, action, conversation=None):
        return "You arrive at countertop 1. On the countertop 1, you see a apple 1."

    async def reflect(self, s, a_draft, s_hat, confidence, admissible, conversation=None):
        from actors.llm import Reflected

        return Reflected("REVISE", self.a_ref, 0.9, 0.9, None)


@pytest.mark.parametrize(("a_ref", "fixed"), [("take apple 1 from countertop 1", True), ("look", False)])
async def test_a_probed_state_whose_gate_opens_scores_the_revision_it_executes(a_ref, fixed):
    """The open gate's action is the reflection's ``a_ref`` (a probe once read a field that does not
    exist there, and every game whose gate opened was dropped as failed)."""
    from types import SimpleNamespace

    from comap_async.config import CoMapConfig
    from evaluator.probes import ProbeState, probe_state, summarize_reflections

    expert = "take apple 1 from countertop 1"
    st = ProbeState(0, expert, "s", "s", frozenset(), ADMISSIBLE, "You pick up the apple 1.", None)
    ctx = SimpleNamespace(llm=ScriptedStep("go to fridge 1", a_ref), cfg=CoMapConfig(), next_state=next_state)
    (row,) = await probe_state(ctx, SimpleNamespace(name="g"), st)
    assert row.gate_reason == "revised" and row.draft_match is False and row.executed_match is fixed
    summary = summarize_reflections([row])
    assert (summary["revisions_fixed"], summary["gate_open_rate"]) == (int(fixed), 1.0)
