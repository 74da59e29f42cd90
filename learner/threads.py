"""How many torch threads the learner's step uses: ``model.torch_threads``, except on a CPU learner in
warm-up SFT and reflection-mode initialisation once the actors have gone quiet (they idle after their share
of the phase's data, and the server has little to decode): then the phase is the learner's alone and it
takes every core it may run on (shared by the ranks of this machine under torchrun).

On a 2-core machine a second learner thread while the actors still play their warm-up episodes does not
share the cores, it fights for them: a run's first three warm-up steps took 209, 161 and 152 s with 2
threads (another run's, with 1, 11-17 s), and 10-12 s each once the actors had stopped (docs/findings.md)."""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass

from comap_async.config import CoMapConfig
from comap_async.wire.messages import REFLECT_INIT, WARMUP

ACTORS_QUIET_S = 60.0
"""Seconds without a new record in the phase's store (:data:`QUIET_STORE`) after which the actors count
as idle: a warm-up episode of the handcoded expert ends every few seconds per actor while they play."""


@dataclass
class QuietWatch:
    """Whether a growing count (a broker store's records written) has stopped growing for ``quiet_s``;
    any change of what is watched (another phase's store) restarts the window like a new record."""

    quiet_s: float = ACTORS_QUIET_S
    count: Hashable = None
    since: float = 0.0  # when ``count`` last changed

    def update(self, count: Hashable, now: float) -> bool:
        if count != self.count:
            self.count, self.since = count, now
            return False
        return now - self.since >= self.quiet_s


QUIET_STORE = {WARMUP: "episodes", REFLECT_INIT: "reflections"}
"""The broker store whose growth says the actors still work in a phase: warm-up episodes, labels."""


def usable_cores() -> int:
    """The cores this process may run on, shared by the learner ranks of this machine (``LOCAL_WORLD_SIZE``
    under torchrun)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def own_threads(cfg: CoMapConfig, phase: str) -> int | None:
    """The phase's own torch threads once the actors are quiet: every usable core (:func:`usable_cores`) for a
    CPU learner in a phase whose actors go quiet (:data:`QUIET_STORE`); ``None``: ``model.torch_threads``
    throughout (co-evolution, a learner on a GPU, and a machine with no more cores than that)."""
    if phase not in QUIET_STORE or cfg.learner.device != "cpu":
        return None
    cores = usable_cores()
    return cores if cores > cfg.model.torch_threads else None


def phase_threads(cfg: CoMapConfig, phase: str, actors_quiet: bool = True) -> int:
    """The learner's torch threads in ``phase``: the phase's own (:func:`own_threads`) while the actors
    are quiet (``actors_quiet``), else ``model.torch_threads``."""
    own = own_threads(cfg, phase)
    return own if own is not None and actors_quiet else cfg.model.torch_threads
