"""What the learner trains on, phase by phase (docs/design.md section 6): the stores a micro-batch
samples, which phases' items each store serves, what co-evolution mixes in from earlier phases, and
the ablations that leave data or loss terms out. Pure functions of the phase and the config.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import Any

from comap_async.wire.messages import COEVOLVE, REFLECT_INIT, WARMUP

PHASE_STORES = {
    WARMUP: ("demos", "transitions"),
    # the paper's reflection-mode initialisation trains the policy's reflection mode (the draft's
    # demonstrations stay as its anchor); the world model rests until co-evolution, so a step's
    # time goes to reflection samples (docs/findings.md)
    REFLECT_INIT: ("demos", "reflections"),
    COEVOLVE: ("demos", "transitions", "reflections"),
}
# The store a micro-batch of a phase cannot do without: warm-up is SFT on demonstrations, and a
# reflection-initialisation step without reflection samples trains nothing of the reflection mode.
PHASE_REQUIRES = {WARMUP: "demos", REFLECT_INIT: "reflections"}
# Which phases' items a store is sampled from, per phase (absent: any). Reflection-mode
# initialisation trains on the suffix-labelled samples; co-evolution's world model on the policy's
# own rollouts, which self-distillation is defined on.
PHASE_FILTERS = {
    (REFLECT_INIT, "reflections"): [REFLECT_INIT],
    (COEVOLVE, "transitions"): [COEVOLVE],
    (COEVOLVE, "reflections"): [COEVOLVE],
}
# ``coevolve`` mixes in items of an earlier phase, each with a probability: the suffix-labelled
# reflection samples (``comap_async.method.phases.SUFFIX_LABEL_SHARE``).
MIXED_IN = {"reflections": [REFLECT_INIT]}


def phase_stores(phase: str, ablation: Collection[str] = ()) -> tuple[str, ...]:
    """The stores a micro-batch of ``phase`` samples, under ``ablation`` (the ablations switched on,
    ``cfg.method.ablation``): ``no_wm_warmup`` and ``frozen_wm`` leave out the world model's transitions in
    warm-up and after it respectively, ``no_expert_sft`` the demonstrations (the draft anchor) after
    warm-up."""
    stores = PHASE_STORES[phase]
    drop = set()
    if ("no_wm_warmup" in ablation and phase == WARMUP) or ("frozen_wm" in ablation and phase != WARMUP):
        drop.add("transitions")
    if "no_expert_sft" in ablation and phase != WARMUP:
        drop.add("demos")
    return tuple(s for s in stores if s not in drop)


def store_requests(
    phase: str,
    n: int,
    shares: dict[str, float],
    rng: random.Random,
    ablation: Collection[str] = (),
    sizes: dict[str, int] | None = None,
) -> list[tuple[str, int, list[str] | None]]:
    """The (store, n, phases) sample requests that make one micro-batch of ``phase``: ``n`` items of
    each store, or ``sizes[store]`` where given.

    In ``coevolve`` each of a store's ``n`` items comes from the earlier phase :data:`MIXED_IN`
    names with probability ``shares[store]`` (so a small share still shows up at small batch
    sizes), else from co-evolution itself.
    """
    reqs: list[tuple[str, int, list[str] | None]] = []
    for store in phase_stores(phase, ablation):
        n = (sizes or {}).get(store, n)
        phases = PHASE_FILTERS.get((phase, store))
        if store == "demos" and phase == COEVOLVE and shares.get("imagined", 0.0) > 0:
            imagined = sum(rng.random() < shares["imagined"] for _ in range(n))
            if imagined:  # the policy's own kept imagined steps stand in for demonstrations (draft loss only)
                reqs.append(("imagined", imagined, None))
            if n - imagined:
                reqs.append((store, n - imagined, phases))
            continue
        mixed = 0
        share = shares.get(store, 0.0) if phase == COEVOLVE and store in MIXED_IN else 0.0
        if share > 0:
            mixed = sum(rng.random() < share for _ in range(n))
            if mixed:
                reqs.append((store, mixed, MIXED_IN[store]))
        if n - mixed:
            reqs.append((store, n - mixed, phases))
    return reqs


def world_model_frozen(cfg: Any, phase: str) -> bool:
    """``frozen_wm``: after warm-up the world model is not trained and its teacher not updated."""
    return "frozen_wm" in cfg.method.ablation and phase != WARMUP


def world_model_terms(ablation: Collection[str]) -> tuple[bool, bool]:
    """(the real-state cross-entropy, the self-distillation KL) the world model's loss holds:
    ``no_real_ce`` and ``no_wmsd`` each leave one out (the config refuses both at once)."""
    return "no_real_ce" not in ablation, "no_wmsd" not in ablation


def reflection_shows_future(ablation: Collection[str]) -> bool:
    """Whether the reflection prompt shows the imagined state (``no_future_state`` leaves it out)."""
    return "no_future_state" not in ablation
