"""CPU priority of a process: on a small machine the learner needs its core more than the actors do.

Lowering a process's priority (raising its Unix niceness) needs no privilege, and the processes it
starts afterwards (the actor's and the evaluator's environment workers) inherit it. Priority only
matters under contention: on an idle core a niced process runs at full speed.
"""

from __future__ import annotations

import os
from typing import Any

ACTOR_NICE = 5
"""An actor's niceness beside a CPU learner: the learner's core comes first (actors are bounded by inference anyway)."""
EVALUATOR_NICE = 10
"""The evaluator's beside a CPU learner: a measurement yields the CPU to the learner and the actors."""


def niceness(cfg: Any, role: str) -> int:
    """How much ``role`` (``actor`` or ``evaluator``) lowers its priority: on a CPU learner's machine they
    share its cores and yield to it; beside a GPU learner they have the CPU to themselves."""
    if cfg.learner.device != "cpu":
        return 0
    return {"actor": ACTOR_NICE, "evaluator": EVALUATOR_NICE}[role]


def lower_priority(nice: int) -> int:
    """Raise this process's niceness by ``nice`` (0 = unchanged); returns the niceness now in force."""
    if nice < 0:
        raise ValueError(f"nice must be >= 0 (a process may only lower its own priority), got {nice}")
    if not hasattr(os, "nice"):  # not a Unix: priority is left to the operating system
        return 0
    return os.nice(nice)
