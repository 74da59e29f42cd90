"""Reflection metrics from judged revisions (pure): suffix comparison, URR / HRR / BRP and counts."""

from __future__ import annotations

import pytest

from actors.episodes import suffix_outcome
from actors.evaluate import markdown, reflection_summary


def test_suffix_outcome_orders_by_win_then_return():
    assert suffix_outcome((True, 1.0), (False, 0.0)) == "better"
    assert suffix_outcome((False, 0.0), (True, 1.0)) == "worse"
    assert suffix_outcome((False, 0.5), (False, 0.0)) == "better"
    assert suffix_outcome((True, 0.0), (False, 3.0)) == "better"  # winning beats any return
    assert suffix_outcome((False, 0.0), (False, 0.0)) == "same"


def test_reflection_summary_worked_example():
    # 4 executed: 2 better, 1 worse, 1 same; 3 blocked: 1 better, 2 same
    outcomes = [(True, "better"), (True, "better"), (True, "worse"), (True, "same"),
                (False, "better"), (False, "same"), (False, "same")]
    r = reflection_summary(outcomes, horizon=5)
    assert r["proposed"] == 7 and r["executed"] == 4
    assert (r["executed_better"], r["executed_worse"], r["executed_same"]) == (2, 1, 1)
    assert (r["blocked_better"], r["blocked_worse"], r["blocked_same"]) == (1, 0, 2)
    assert r["urr"] == pytest.approx(0.5) and r["hrr"] == pytest.approx(0.25)
    assert r["brp"] == pytest.approx(2 / 3) and r["suffix_horizon"] == 5


def test_reflection_summary_without_revisions_has_no_rates():
    r = reflection_summary([], horizon=3)
    assert r["proposed"] == 0 and r["urr"] is None and r["hrr"] is None and r["brp"] is None
    r = reflection_summary([(False, "worse")], horizon=3)
    assert r["executed"] == 0 and r["urr"] is None and r["brp"] is None


def test_markdown_shows_the_reflection_table_only_when_measured():
    report = {"split": "valid_seen", "adapter_version": 2, "games": 1, "success_rate": 1.0, "mean_steps": 3.0,
              "delta_f1": None, "revision_rate": 0.5, "invalid_action_rate": 0.0,
              "episodes": [{"game": "g", "won": True, "steps": 3, "revisions": 1}]}
    assert "URR" not in markdown(report)
    report["reflection"] = reflection_summary([(True, "better")], horizon=5)
    md = markdown(report)
    assert "| proposed | executed | URR | HRR | BRP |" in md and "| 1 | 1 | 1.000 | 0.000 | 1.000 |" in md
