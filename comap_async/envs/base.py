"""The text-environment protocol every benchmark implements (docs/design.md section 8)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class GameInfo:
    """One playable game: where its file is and what kind of task it poses."""

    path: str
    """The game file (for ALFWorld a ``game.tw-pddl``)."""
    split: str
    """``train``, ``valid_seen``, ``valid_unseen`` or ``valid_train``."""
    task_type: int
    """Task family id (ALFWorld: 1-6, see ``alfworld_games.TASK_TYPES``)."""
    name: str
    """Stable short id: ``<split>/<task folder>/<trial>``."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the environment answers after ``reset`` or ``step``."""

    observation: str
    """Observation text (after ``reset``: the intro, which carries ``Your task is to: ...``)."""
    won: bool
    """The game's goal holds."""
    done: bool
    """The episode is over: won, or the step limit reached."""
    admissible: tuple[str, ...]
    """Commands the engine accepts in the new state (sorted)."""
    expert_action: str | None
    """The handcoded expert's next action, ``None`` when it has none (failed or timed out)."""
    reward: float = 0.0
    """1.0 when won, else 0.0."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extras: ``task`` (after reset), ``steps``, ``truncated``, ``expert_error``."""
    location: str = ""
    """Where the agent is, as the environment describes it after this step (ScienceWorld: the room's
    description from its free ``look``); '' where the environment has none (ALFWorld: its admissible
    list tells what is around). The state shows it with ``env.show_location``."""


@runtime_checkable
class TextEnv(Protocol):
    """A synchronous text game; :mod:`comap_async.envs.pool` runs these in worker processes."""

    max_steps: int

    def reset(self, game: GameInfo | str) -> StepResult:
        """Load ``game`` (when it is not the current one) and start a new episode."""
        ...

    def step(self, action: str) -> StepResult:
        """Execute one command; unknown commands answer like the game does (no exception)."""
        ...

    def restore(self, game: GameInfo | str, actions: Sequence[str]) -> StepResult:
        """Re-create the state after ``actions`` from a fresh reset (restore by replay)."""
        ...

    def walkthrough(self) -> list[str]:
        """The current game's recorded winning command sequence (after ``reset``): warm-up's
        demonstrations, reflection-mode initialisation's expert branch, the probes' states."""
        ...

    def close(self) -> None: ...


class RestoreDiverged(RuntimeError):
    """A replayed prefix ended the episode (a win, a loss) within it: the environment did not do
    what it did the first time (ScienceWorld 1.2.3 is not deterministic for about half its tasks),
    so the state to restore cannot be rebuilt. Callers skip what needed it."""


def replay(env: Any, game: GameInfo | str, actions: Sequence[str]) -> StepResult:
    """``env.restore`` for an environment with ``reset``/``step``, a ``max_steps`` limit and a
    ``steps``/``done`` episode state: reset and replay ``actions``; the step limit does not cut a
    replay short, and afterwards it applies again. :class:`RestoreDiverged` when the replay ends
    the episode (early, or with its last action): the caller restores a state to act in."""
    result = env.reset(game)
    limit, env.max_steps = env.max_steps, max(env.max_steps, len(actions) + 1)
    try:
        for action in actions:
            if result.done:
                break
            result = env.step(action)
        # a prefix is restored to act after it: an episode over within it went otherwise the first time
        if result.done:
            raise RestoreDiverged(
                f"replaying {len(actions)} actions on {getattr(game, 'name', game)}: the "
                f"episode ended after {env.steps} (won={result.won}); it did not the first time"
            )
    finally:
        env.max_steps = limit
    env.done = env.steps >= env.max_steps  # not won: that raised above
    return result


def spread_sample(games: Sequence[GameInfo], n: int | None, seed: int) -> list[GameInfo]:
    """``n`` games drawn with ``seed`` and spread over the task types: one of each type in turn (the
    types in a seeded order, the games of a type shuffled), so a small evaluation is not one task
    family from one scene. Sorted by name; all games when ``n`` is None or at least their number."""
    import random

    ordered = sorted(games, key=lambda g: g.name)
    if n is None or n >= len(ordered):
        return ordered
    rng = random.Random(f"spread:{seed}")
    by_type: dict[int, list[GameInfo]] = {}
    for g in ordered:
        by_type.setdefault(g.task_type, []).append(g)
    queues = [by_type[t] for t in sorted(by_type)]
    for q in queues:
        rng.shuffle(q)
    rng.shuffle(queues)
    picked: list[GameInfo] = []
    while len(picked) < n:
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop())
    return sorted(picked, key=lambda g: g.name)
