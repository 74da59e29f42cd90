"""CPU priority of a process: on a small machine the learner needs its core more than the actors do.

Lowering a process's priority (raising its Unix niceness) needs no privilege, and the processes it
starts afterwards (the actor's and the evaluator's environment workers) inherit it. Priority only
matters under contention: on an idle core a niced process runs at full speed.
"""

from __future__ import annotations

import os


def lower_priority(nice: int) -> int:
    """Raise this process's niceness by ``nice`` (0 = unchanged); returns the niceness now in force."""
    if nice < 0:
        raise ValueError(f"nice must be >= 0 (a process may only lower its own priority), got {nice}")
    if not hasattr(os, "nice"):  # not a Unix: priority is left to the operating system
        return 0
    return os.nice(nice)
