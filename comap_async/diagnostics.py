"""Per-episode diagnostics that are not the method's: the loop count of an episode's steps. (What a
branch comparison means, the reflection labels and URR, HRR, BRP, is the method's:
:mod:`comap_async.method.labels`.)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def loop_steps(state_actions: Iterable[tuple[Any, str]]) -> int:
    """How many steps repeat an action already taken from the same state: ``(state, action)``
    pairs in episode order (the state as canonical facts, the action canonical). A cycle counts from
    its second turn on (each of its steps then comes back to a state where it took that action), as
    does an action repeated where it changes nothing. Admissible actions can loop: the
    invalid-action rate does not see this."""
    seen: set[tuple[Any, str]] = set()
    repeats = 0
    for pair in state_actions:
        repeats += pair in seen
        seen.add(pair)
    return repeats
