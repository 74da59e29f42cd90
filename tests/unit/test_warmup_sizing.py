"""Warm-up sized by data and time: the phase ends after ``learner.phases.warmup.epochs`` passes
over the demonstrations (at least its ``steps``) or its ``max_minutes`` of training, and the
learning rate spans that budget."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from comap_async.config import load_config
from learner.loop import Learner, LearnerState
from learner.schedule import PhaseSchedule
from learner.threads import QuietWatch, own_threads, phase_threads


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
    cfg = load_config(None, ["learner.phases.warmup.steps=10", "learner.lr=1.0"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = PhaseSchedule(opt, cfg.learner)
    sched.enter("warmup", 0, budget=100)
    assert sched.lr_at(1) < 1.0 and sched.lr_at(2) == pytest.approx(1.0)  # warmed up over 3% of 100 steps
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


def test_a_cpu_learner_takes_every_core_once_the_actors_are_quiet(monkeypatch):
    """Warm-up SFT and reflection-mode initialisation are the learner's alone once the actors idle: a CPU
    learner then trains on every core it may run on (shared by the ranks of a machine); co-evolution, and a
    learner on a GPU, stay on ``model.torch_threads``."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config(None, ["model.torch_threads=1"])
    assert [phase_threads(cfg, p) for p in ("warmup", "reflect_init", "coevolve")] == [4, 4, 1]
    assert phase_threads(cfg, "warmup", actors_quiet=False) == 1  # the actors still play: no second thread
    assert phase_threads(cfg, "reflect_init", actors_quiet=False) == 1  # labels still coming: the actors play
    gpu = load_config(None, ["model.torch_threads=3", "learner.device=cuda"])
    assert [phase_threads(gpu, p) for p in ("warmup", "reflect_init", "coevolve")] == [3, 3, 3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this machine: two cores each
    assert phase_threads(cfg, "warmup") == 2
    assert own_threads(load_config(None, ["model.torch_threads=2"]), "warmup") is None  # no more cores than that


def test_actors_count_as_quiet_once_no_episode_came_for_the_window():
    watch = QuietWatch(quiet_s=60.0)
    assert not watch.update(5, now=0.0)  # first look: nothing known yet
    assert not watch.update(5, now=59.0)
    assert watch.update(5, now=60.0)
    assert not watch.update(6, now=61.0)  # a new episode: playing again, the window restarts
    assert not watch.update(6, now=120.0) and watch.update(6, now=121.0)
    # the next phase's store, whatever its count: a window of its own
    assert not watch.update(("reflect_init", 6), now=200.0) and watch.update(("reflect_init", 6), now=260.0)
