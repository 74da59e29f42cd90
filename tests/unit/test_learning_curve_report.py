"""The learning-curve benchmark's cut at an earlier wall time (equal-budget comparisons, issue 14)."""

from __future__ import annotations

import math

from benchmarks.learning_curve import cut, gains

T0 = 1000.0


def _snap(minute: float, transitions: int, tokens: int | None, step: int) -> dict:
    return {"t": T0 + 60 * minute, "registry": {"step": step}, "written": {"transitions": transitions},
            "learner_tokens_total": tokens}


RESULTS = [
    {"version": 0, "ts": T0 + 60 * 5, "wm_delta_f1": 0.0, "draft_accuracy": 0.05, "success_rate": 0.0},
    {"version": 3, "ts": T0 + 60 * 30, "wm_delta_f1": 0.4, "draft_accuracy": 0.30, "success_rate": 0.0},
    {"version": 9, "ts": T0 + 60 * 70, "wm_delta_f1": 0.6, "draft_accuracy": 0.45, "success_rate": 1.0},
]
PROGRESS = [_snap(10, 100, None, 0), _snap(30, 400, 30_000, 60), _snap(45, 600, 45_000, 90),
            _snap(60, 900, 80_000, 120), _snap(90, 1500, 150_000, 200)]


def test_cut_uses_only_what_existed_by_then():
    at45 = cut(RESULTS, PROGRESS, T0, 45)
    assert at45["learner_step"] == 90
    assert math.isclose(at45["transitions_per_s"], 600 / (45 * 60))
    assert math.isclose(at45["learner_tokens_per_s"], 45_000 / (45 * 60))
    # version 9 was evaluated at minute 70: not part of a 45-minute run
    assert math.isclose(at45["wm_delta_f1_gain"], 0.4) and math.isclose(at45["draft_accuracy_gain"], 0.25)
    whole = cut(RESULTS, PROGRESS, T0, 91)
    assert whole["learner_step"] == 200 and math.isclose(whole["success_rate_gain"], 1.0)


def test_cut_before_any_learner_figure_reports_none():
    early = cut(RESULTS, PROGRESS, T0, 12)
    assert early["learner_tokens_per_s"] is None
    assert early["wm_delta_f1_gain"] == 0.0  # only the base model evaluated: latest minus base
    assert cut([], [], T0, 5)["wm_delta_f1_gain"] is None


def test_gains_need_the_base_model():
    assert gains(RESULTS[1:])["wm_delta_f1"] is None
