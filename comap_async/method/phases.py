"""Each phase as the method reads it: one frozen :class:`PhaseSpec` built from the config's
``learner.phases.<phase>`` section and the learner's shared settings (docs/design.md section 6).

A spec says what a phase trains on (the stores of :mod:`comap_async.method.routing`, ablations applied),
when it may start (``min_samples`` items of the store it cannot do without), how long it lasts (its step
budget, sized by data with ``epochs``, capped by ``max_minutes``) and what follows it, and at what rate
it trains and publishes. The learner's modules read the spec, never the config's per-phase fields;
co-evolution's mixed-in shares are :func:`coevolve_shares`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from comap_async.method.routing import PHASE_REQUIRES, phase_stores
from comap_async.wire.messages import COEVOLVE, REFLECT_INIT, WARMUP

PHASES = (WARMUP, REFLECT_INIT, COEVOLVE)

SUFFIX_LABEL_SHARE = 0.5
"""Expected share of each co-evolution reflection batch drawn from the suffix-labelled samples of
reflection-mode initialisation (labelled by outcome, not by a policy version: never stale); the rest are
the gate's samples of the policy's own steps. Without them a gate that stays shut trains only keep
samples and keeps itself shut (docs/findings.md, "Under self-labelling the gate shuts itself")."""
IMAGINED_DEMO_SHARE = 0.25
"""With imagined episodes (``actor.imagined_rollouts``), the expected share of each co-evolution
micro-batch's demonstrations drawn from the imagined store instead, trained with the draft loss (the
share the imagined-episode runs of the method table trained with)."""


@dataclass(frozen=True)
class PhaseSpec:
    phase: str
    stores: tuple[str, ...]
    """The stores a micro-batch of the phase samples (:func:`~comap_async.method.routing.phase_stores`)."""
    requires: str | None
    """The store the phase waits for before it trains (None: co-evolution waits for nothing)."""
    min_samples: int
    """Items ``requires`` must hold before the phase trains."""
    batch_size: int
    """Items of ``requires`` per micro-batch (co-evolution: every store's ``learner.batch_size``)."""
    steps: int
    """The configured step budget: the horizon of the phase's learning-rate schedule, and the least steps
    a phase sized by data trains."""
    epochs: float | None
    """Size the budget by data: passes over the items ``requires`` holds when training starts."""
    max_minutes: float | None
    """The phase ends after this much training time even when its budget is not spent (None: no limit)."""
    then: str | None
    """The phase after this one once its budget or time is spent (None: co-evolution never ends)."""
    lr: float
    """Peak learning rate."""
    publish_every: int | None
    """Steps between published versions (None: warm-up publishes only when it ends)."""

    def sized_steps(self, held: int, micro_batches: int) -> int:
        """The budget sized by data: ``epochs`` passes over ``held`` items at ``micro_batches`` micro-batches
        (``grad_accum`` times the ranks) of ``batch_size`` per optimizer step, at least ``steps``."""
        assert self.epochs is not None, f"{self.phase} is not sized by data"
        return max(self.steps, math.ceil(self.epochs * held / (micro_batches * self.batch_size)))

    def done(self, steps: int, budget: int | None, seconds: float) -> bool:
        """Whether the phase ends after ``steps`` of its own steps and ``seconds`` of training, its budget
        ``budget`` when sized by data (else ``steps`` configured)."""
        if self.then is None:
            return False
        out_of_time = self.max_minutes is not None and seconds >= 60 * self.max_minutes
        return steps >= (budget or self.steps) or out_of_time


def phase_spec(learner: Any, phase: str, ablation: Collection[str] = ()) -> PhaseSpec:
    """The spec of ``phase`` under ``learner`` (a ``LearnerConfig``) and ``ablation`` (the ablations
    switched on, ``cfg.method.ablation``; none: the method itself, for a caller that reads only rates, budgets
    and weights, as the trainer's schedule does)."""
    lc = learner
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; expected one of {list(PHASES)}")
    common = {"phase": phase, "stores": phase_stores(phase, ablation), "requires": PHASE_REQUIRES.get(phase)}
    if phase == WARMUP:
        warmup = lc.phases.warmup
        return PhaseSpec(
            **common,
            min_samples=warmup.min_samples,
            batch_size=lc.batch_size,
            steps=warmup.steps,
            epochs=warmup.epochs,
            max_minutes=warmup.max_minutes,
            then=after_warmup(lc, ablation),
            lr=lc.lr,
            publish_every=warmup.publish_every,
        )
    if phase == REFLECT_INIT:
        reflect = lc.phases.reflect_init
        return PhaseSpec(
            **common,
            min_samples=reflect.min_samples,
            batch_size=reflect.batch_size or lc.batch_size,
            steps=reflect.steps,
            epochs=reflect.epochs,
            max_minutes=reflect.max_minutes,
            then=COEVOLVE,
            lr=lc.lr if reflect.lr is None else reflect.lr,
            publish_every=lc.publish_every,
        )
    co = lc.phases.coevolve
    return PhaseSpec(
        **common,
        min_samples=0,
        batch_size=lc.batch_size,
        steps=co.steps,
        epochs=None,
        max_minutes=None,
        then=None,
        lr=lc.lr if co.lr is None else co.lr,
        publish_every=lc.publish_every,
    )


def coevolve_shares(cfg: Any) -> Mapping[str, float]:
    """Per store, the expected share of co-evolution's items drawn from elsewhere (``cfg`` a ``CoMapConfig``):
    reflection samples from reflection-mode initialisation (:data:`SUFFIX_LABEL_SHARE`,
    :data:`~comap_async.method.routing.MIXED_IN`) and, when the actors play imagined episodes,
    demonstrations from the imagined store (``imagined``: :data:`IMAGINED_DEMO_SHARE`)."""
    shares = {"reflections": SUFFIX_LABEL_SHARE}
    if cfg.actor.imagined_rollouts > 0:
        shares["imagined"] = IMAGINED_DEMO_SHARE
    return shares


def first_phase(cfg: Any) -> str:
    """Where a fresh learner starts (``cfg`` a ``CoMapConfig``): warm-up, unless it has no steps; else
    reflection-mode initialisation, unless that is ablated (``no_reflect_init``)."""
    if cfg.learner.phases.warmup.steps > 0:
        return WARMUP
    return COEVOLVE if "no_reflect_init" in cfg.method.ablation else REFLECT_INIT


def after_warmup(learner: Any, ablation: Collection[str] = ()) -> str:
    """The phase after warm-up: reflection-mode initialisation, unless it has no steps or is ablated."""
    if learner.phases.reflect_init.steps > 0 and "no_reflect_init" not in ablation:
        return REFLECT_INIT
    return COEVOLVE
