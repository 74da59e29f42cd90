"""Warm-up sized by data and time: the phase ends after ``learner.phases.warmup.epochs`` passes
over the demonstrations (at least its ``steps``) or its ``max_minutes`` of training, and the
learning rate spans that budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from comap_async.config import load_config
from learner.loop import Learner, LearnerState
from learner.schedule import PhaseSchedule
from learner.threads import QuietWatch, phase_threads


def _next(cfg, state: LearnerState, step: int):
    return Learner.next_phase(SimpleNamespace(cfg=cfg, state=state, trainer=SimpleNamespace(step=step)))


def test_warmup_ends_after_its_data_budget_or_its_time():
    cfg = load_config(
        None,
        ["learner.phases.warmup.steps=10", "learner.phases.warmup.epochs=2", "learner.phases.warmup.max_minutes=30"],
    )
    sized = LearnerState(phase="warmup", phase_budget=150)  # 2 epochs over 150 demos at batch 2
    assert _next(cfg, sized, 149) is None and _next(cfg, sized, 150) == "reflect_init"
    late = LearnerState(phase="warmup", phase_budget=150, phase_seconds=30 * 60)
    assert _next(cfg, late, 20) == "reflect_init"  # out of time before the budget is spent
    plain = LearnerState(phase="warmup")  # no data-sized budget: its steps
    assert _next(cfg, plain, 9) is None and _next(cfg, plain, 10) == "reflect_init"


def test_the_learning_rate_spans_the_data_sized_budget():
    cfg = load_config(None, ["learner.phases.warmup.steps=10", "learner.warmup_ratio=0.1", "learner.lr=1.0"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = PhaseSchedule(opt, cfg.learner)
    sched.enter("warmup", 0, budget=100)
    assert sched.lr_at(9) == pytest.approx(1.0)  # warmed up over 10% of 100 steps, at the peak
    assert sched.lr_at(55) > 0.4 and sched.lr_at(99) < 0.2  # decays over the 100, not over its steps
    restored = PhaseSchedule(opt, cfg.learner)
    restored.load_state_dict(sched.state_dict())
    assert restored.lr_at(55) == sched.lr_at(55)


def test_warmup_publishes_only_when_configured():
    def every(overrides, phase):
        cfg = load_config(None, ["learner.publish_every=7", *overrides])
        return Learner._publish_every(SimpleNamespace(cfg=cfg, state=LearnerState(phase=phase)))

    assert every([], "coevolve") == 7 and every([], "warmup") > 10**9
    assert every(["learner.phases.warmup.publish_every=20"], "warmup") == 20


def test_warmup_trains_on_its_own_threads():
    cfg = load_config(None, ["learner.phases.warmup.torch_threads=2", "model.torch_threads=1"])
    assert [phase_threads(cfg, p) for p in ("warmup", "reflect_init", "coevolve")] == [2, 1, 1]
    plain = load_config(None, ["model.torch_threads=3"])  # unset: every phase on model.torch_threads
    assert [phase_threads(plain, p) for p in ("warmup", "reflect_init", "coevolve")] == [3, 3, 3]
    assert phase_threads(cfg, "warmup", actors_quiet=False) == 1  # the actors still play: no second thread


def test_reflect_init_trains_on_its_own_threads_once_the_labels_stop():
    cfg = load_config(None, ["learner.phases.reflect_init.torch_threads=2", "model.torch_threads=1"])
    assert [phase_threads(cfg, p) for p in ("warmup", "reflect_init", "coevolve")] == [1, 2, 1]
    assert phase_threads(cfg, "reflect_init", actors_quiet=False) == 1  # labels still coming: the actors play


def test_actors_count_as_quiet_once_no_episode_came_for_the_window():
    watch = QuietWatch(quiet_s=60.0)
    assert not watch.update(5, now=0.0)  # first look: nothing known yet
    assert not watch.update(5, now=59.0)
    assert watch.update(5, now=60.0)
    assert not watch.update(6, now=61.0)  # a new episode: playing again, the window restarts
    assert not watch.update(6, now=120.0) and watch.update(6, now=121.0)
    # the next phase's store, whatever its count: a window of its own
    assert not watch.update(("reflect_init", 6), now=200.0) and watch.update(("reflect_init", 6), now=260.0)
