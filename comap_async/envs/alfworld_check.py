"""Per-game health check: the walkthrough wins, the expert labels every step, the facts parse.

Used by ``comap env check`` and the integration tests; :func:`check_games` spreads games over
worker processes (each installs the TextWorld caches once and keeps them across its games).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from comap_async.envs.alfworld_facts import parse_facts
from comap_async.envs.base import GameInfo
from comap_async.facts import delta_f1


@dataclass
class GameCheck:
    name: str
    walkthrough_won: bool
    walkthrough_steps: int
    expert_missing_steps: int
    """Walkthrough states before the win (reset included) that had no expert action."""
    expert_from_walkthrough: int
    """Walkthrough steps labelled by the walkthrough because the handcoded expert had failed."""
    expert_won: bool
    expert_steps: int
    observations: int
    unparseable: list[str] = field(default_factory=list)
    self_f1_below_one: int = 0
    """Real transitions where Delta-F1 of the real observation against itself was not 1.0."""


_ENV = None


def _env(max_steps: int):  # one env per worker process, reused across its games
    global _ENV
    if _ENV is None or _ENV.max_steps != max_steps:
        from comap_async.envs.alfworld_env import AlfworldEnv

        _ENV = AlfworldEnv(max_steps=max_steps)
    return _ENV


def check_game(game: GameInfo, max_steps: int = 50, run_expert: bool = True) -> GameCheck:
    env = _env(max_steps)
    results = [env.reset(game)]
    walk = env.walkthrough()
    # the walkthrough may be longer than the step limit: replay it in full
    limit, env.max_steps = env.max_steps, max(env.max_steps, len(walk) + 1)
    try:
        for action in walk:
            results.append(env.step(action))
    finally:
        env.max_steps = limit
    facts = [parse_facts(r.observation) for r in results]
    unparseable = [r.observation for r, f in zip(results, facts) if f is None]
    below = sum(
        1 for prev, real in zip(facts, facts[1:]) if prev is not None and real is not None and delta_f1(prev, real, real) != 1.0
    )
    check = GameCheck(
        name=game.name,
        walkthrough_won=results[-1].won,
        walkthrough_steps=len(walk),
        expert_missing_steps=sum(1 for r in results if r.expert_action is None and not r.won),
        expert_from_walkthrough=sum(1 for r in results if r.info.get("expert_source") == "walkthrough"),
        expert_won=False,
        expert_steps=0,
        observations=len(results),
        unparseable=unparseable,
        self_f1_below_one=below,
    )
    if not run_expert:
        return check
    result = env.reset(game)
    while not result.done and result.expert_action is not None:
        result = env.step(result.expert_action)
    check.expert_won, check.expert_steps = result.won, env.steps
    return check


def check_games(
    games: Sequence[GameInfo], max_steps: int = 50, workers: int = 1, run_expert: bool = True
) -> Iterator[GameCheck]:
    """Check games in ``workers`` processes; yields results as they finish (any order)."""
    if workers <= 1:
        for game in games:
            yield check_game(game, max_steps, run_expert)
        return
    with mp.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(_check_star, [(g, max_steps, run_expert) for g in games], chunksize=1)


def _check_star(args: tuple[GameInfo, int, bool]) -> GameCheck:
    return check_game(*args)

