"""Reflection diagnostics (pure): branch comparison, reflection-init labels, URR / HRR / BRP exactly
as the paper's appendix C.2 defines them (docs/design.md section 11), on hand-built step lists."""

from __future__ import annotations

import pytest

from comap_async.method.labels import EPS, BranchResult, branch_better, reflection_diagnostics, reflection_label
from evaluator.eval_report import markdown, reflection_summary

WIN3, WIN5, LOSE = BranchResult(True, 3), BranchResult(True, 5), BranchResult(False, 50)


def test_branch_better_wins_first_then_fewer_steps():
    assert branch_better(WIN5, LOSE) and not branch_better(LOSE, WIN5)
    assert branch_better(WIN3, WIN5) and not branch_better(WIN5, WIN3)
    assert not branch_better(WIN3, WIN3)  # a tie is not better
    assert not branch_better(LOSE, BranchResult(False, 10))  # two losses: neither is better


def test_reflection_labels():
    assert reflection_label(True, None, None) == (0, "equal_draft")  # kept, not skipped
    assert reflection_label(False, WIN3, LOSE) == (1, "expert_better")
    assert reflection_label(False, WIN3, WIN5) == (1, "expert_sooner")  # both win, the expert in fewer steps
    assert reflection_label(False, WIN3, WIN3) == (0, "not_better")  # tie: the draft is kept
    assert reflection_label(False, LOSE, LOSE) == (0, "not_better")
    assert reflection_label(False, WIN5, WIN3) == (0, "not_better")
    # the paper's label (method.reflect_init_label: paper): a higher success rate alone
    assert reflection_label(False, WIN3, LOSE, sooner=False) == (1, "expert_better")
    assert reflection_label(False, WIN3, WIN5, sooner=False) == (0, "not_better")  # a detour that wins is kept
    assert reflection_label(True, None, None, sooner=False) == (0, "equal_draft")
    with pytest.raises(ValueError):
        reflection_label(False, None, WIN3)


def test_urr_hrr_brp_worked_example():
    steps = [  # (m, z_draft, z_ref)
        (1, 1, 1),  # a winning draft revised, still wins: over-intervention, harmless
        (1, 1, 0),  # a winning draft revised into a loss: harmful
        (0, 1, 0),  # a winning draft kept
        (0, 1, 1),
        (1, 0, 1),  # a losing draft revised into a win: beneficial
        (1, 0, 0),  # a losing draft revised, still loses
        (0, 0, 1),  # a beneficial revision the gate blocked
        (0, 0, 0),
    ]
    r = reflection_diagnostics(steps)
    assert (r["steps"], r["sum_m"], r["sum_z_draft"]) == (8, 4, 4)
    assert (r["sum_m_z_draft"], r["sum_m_z_draft_not_z_ref"], r["sum_m_not_z_draft_z_ref"]) == (2, 1, 1)
    assert r["urr"] == pytest.approx(2 / 4) and r["hrr"] == pytest.approx(1 / 4) and r["brp"] == pytest.approx(1 / 4)
    assert r["urr"] == 2 / (4 + EPS)  # the paper's ε in the denominator, exactly


def test_degenerate_cases_give_zero_not_errors():
    # no successful drafts: URR and HRR have an empty denominator
    r = reflection_diagnostics([(1, 0, 1), (0, 0, 0)])
    assert r["sum_z_draft"] == 0 and r["urr"] == 0.0 and r["hrr"] == 0.0 and r["brp"] == pytest.approx(1.0)
    # no executed revisions: BRP has an empty denominator, URR is 0 by definition
    r = reflection_diagnostics([(0, 1, 0), (0, 0, 1)])
    assert r["sum_m"] == 0 and r["brp"] == 0.0 and r["urr"] == 0.0 and r["hrr"] == 0.0
    r = reflection_diagnostics([])
    assert r["steps"] == 0 and (r["urr"], r["hrr"], r["brp"]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        reflection_diagnostics([(2, 0, 1)])


def test_markdown_shows_the_reflection_table_only_when_measured():
    report = {
        "split": "valid_seen",
        "adapter_version": 2,
        "games": 1,
        "success_rate": 1.0,
        "mean_steps": 3.0,
        "delta_f1": None,
        "revision_rate": 0.5,
        "invalid_action_rate": 0.0,
        "episodes": [{"game": "g", "won": True, "steps": 3, "revisions": 1}],
    }
    assert "URR" not in markdown(report)
    report["reflection"] = reflection_summary([(1, 0, 1), (0, 1, 1)], max_steps=50)
    assert report["reflection"]["sum_m_not_z_draft_z_ref"] == 1 and report["reflection"]["branch_max_steps"] == 50
    md = markdown(report)
    assert "| 2 | 1 | 1 | 0.000 | 0.000 | 1.000 |" in md
