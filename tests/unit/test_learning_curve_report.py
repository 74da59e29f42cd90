"""The learning-curve study's cut (``experiments/studies/learning_curve.py``) at an earlier wall time
(equal-budget comparisons)."""

from __future__ import annotations

import math

from experiments.studies.learning_curve import cut, gains, publishes

T0 = 1000.0


def _snap(minute: float, transitions: int, tokens: int | None, step: int) -> dict:
    return {
        "t": T0 + 60 * minute,
        "registry": {"step": step},
        "written": {"transitions": transitions},
        "learner_tokens_total": tokens,
    }


RESULTS = [
    {"version": 0, "ts": T0 + 60 * 5, "wm_delta_f1": 0.0, "draft_accuracy": 0.05, "success_rate": 0.0},
    {"version": 3, "ts": T0 + 60 * 30, "wm_delta_f1": 0.4, "draft_accuracy": 0.30, "success_rate": 0.0},
    {"version": 9, "ts": T0 + 60 * 70, "wm_delta_f1": 0.6, "draft_accuracy": 0.45, "success_rate": 1.0},
]
PROGRESS = [
    _snap(10, 100, None, 0),
    _snap(30, 400, 30_000, 60),
    _snap(45, 600, 45_000, 90),
    _snap(60, 900, 80_000, 120),
    _snap(90, 1500, 150_000, 200),
]


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


def test_cut_reports_coevolve_throughput_apart_from_warmup():
    def snap(minute: float, phase: str, transitions: int, tokens: int) -> dict:
        return {
            "t": T0 + 60 * minute,
            "registry": {"phase": phase},
            "written": {"transitions": transitions},
            "learner_tokens_total": tokens,
        }

    progress = [
        snap(10, "warmup", 1000, 10_000),
        snap(20, "reflect_init", 1500, 20_000),
        snap(30, "coevolve", 1600, 25_000),
        snap(40, "coevolve", 1720, 31_000),
        snap(50, "coevolve", 1840, 37_000),
    ]
    at45 = cut([], progress, T0, 45)
    assert math.isclose(at45["coevolve_minutes"], 10.0)
    assert math.isclose(at45["coevolve_transitions_per_s"], 120 / 600)
    assert math.isclose(at45["coevolve_learner_tokens_per_s"], 6_000 / 600)
    whole = cut([], progress, T0, 50)
    assert math.isclose(whole["coevolve_transitions_per_s"], 240 / 1200)
    # one snapshot in the phase is no span: no rate rather than a division by zero
    early = cut([], progress, T0, 35)
    assert early["coevolve_minutes"] == 0.0 and early["coevolve_transitions_per_s"] is None


def test_publishes_read_from_the_json_log_in_order(tmp_path):
    log = tmp_path / "honcho.log"
    t0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
    log.write_text(
        "22:13:20 system      | learner.1 started (pid=1)\n"
        '22:16:20 learner.1   | {"version": 1, "phase": "reflect_init", "step": 20, "event": "publish.done", '
        '"timestamp": "2023-11-14T22:16:20Z"}\n'
        '22:17:00 learner.1   | {"event": "learner.step", "step": 21, "timestamp": "2023-11-14T22:17:00Z"}\n'
        '22:22:20 learner.1   | {"version": 2, "phase": "coevolve", "step": 30, "event": "publish.done", '
        '"timestamp": "2023-11-14T22:22:20Z"}\n'
        '22:22:21 learner.1   | {"event": "publish.done", "timest\n'
    )
    got = publishes(log, t0)
    assert [(p["version"], p["phase"], p["step"]) for p in got] == [(1, "reflect_init", 20), (2, "coevolve", 30)]
    assert [round(p["minutes"], 3) for p in got] == [3.0, 9.0]
    assert publishes(tmp_path / "missing.log", t0) == []
