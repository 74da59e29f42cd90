"""The learning rate of a step, phase by phase, and gradient clipping per role (docs/design.md
section 6): pure functions of the step, the phase and the config, so a resumed trainer repeats an
uninterrupted one's rates exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from comap_async.config import LearnerConfig
from comap_async.method.phases import phase_spec
from comap_async.wire.messages import WARMUP

WARMUP_RATIO = 0.03
"""Share of each phase's step budget spent in linear learning-rate warm-up before its cosine decay (the
paper's 3 %; every run config had it): every phase starts its own schedule, so a short phase still
reaches the peak rate."""


def cosine_with_warmup(step: int, total: int, warmup_ratio: float = WARMUP_RATIO, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up, cosine decay to ``floor`` at ``total`` steps, flat afterwards."""
    warm = max(1, int(total * warmup_ratio))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


MAX_GRAD_NORM = 1.0  # per role (the paper's trainer clips at 1.0)


class PhaseSchedule:
    """The learning rate of a step from its phase and the steps since that phase began.

    One schedule over the global step let warm-up SFT end before the rate reached its peak (a
    20-step phase inside a 10,000-step warm-up ratio); here each phase restarts the warm-up and
    the cosine decay over its own budget (its spec's ``steps`` or the budget sized by data; co-evolution's
    ``learner.phases.coevolve.steps``, then flat at the floor) at its spec's peak ``lr``.
    The rate is a pure function of (phase, phase_start, step), so a trainer resumed from a
    checkpoint at any step uses exactly the rate an uninterrupted one would.
    """

    warmup_ratio: float = WARMUP_RATIO
    """:data:`WARMUP_RATIO`; a test sets 0 to train at the peak rate from the first step."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, cfg: LearnerConfig, phase: str = WARMUP, phase_start: int = 0
    ) -> None:
        self.optimizer, self.cfg = optimizer, cfg
        self.enter(phase, phase_start)

    def enter(self, phase: str, start: int, budget: int | None = None) -> None:
        """Start ``phase`` at global step ``start`` (the number of steps completed before it);
        ``budget`` replaces the configured step budget (a phase sized by data)."""
        phase_spec(self.cfg, phase)  # refuses an unknown phase
        self.phase, self.phase_start, self.budget = phase, int(start), budget

    def lr_at(self, step: int) -> float:
        """The rate of the step that runs when ``step`` steps are complete."""
        spec = phase_spec(self.cfg, self.phase)
        budget = max(1, self.budget or spec.steps)
        since = max(0, step - self.phase_start)
        return spec.lr * cosine_with_warmup(since, budget, self.warmup_ratio)

    def apply(self, step: int) -> float:
        """Set the optimizer's rate for the step about to be taken; returns it."""
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "phase_start": self.phase_start, "budget": self.budget}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the phase; a checkpoint from before per-phase schedules (a LambdaLR state) has
        none, and the learner sets it from its saved phase instead."""
        if "phase" in state:
            self.enter(state["phase"], state["phase_start"], state.get("budget"))


def clip_per_role(role_params: dict[str, list[torch.nn.Parameter]], max_norm: float) -> dict[str, float]:
    """Clip each role's gradients to ``max_norm`` on its own; returns each role's norm before clipping.

    Clipping over both adapters at once let a large world-model gradient (long ``s_next`` targets,
    the KL of a fresh teacher) scale the policy's gradient down, and the other way round.
    """
    norms = {}
    for role, params in role_params.items():
        grads = [p for p in params if p.grad is not None]
        norms[role] = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
    return norms
