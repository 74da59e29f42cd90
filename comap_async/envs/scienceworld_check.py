"""``comap env check --env scienceworld``: replay every game's gold sequence and time the simulator.

Each worker process holds one simulator (one JVM) for all the games it is given, as an actor's
environment does across episodes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from comap_async.envs.base import GameInfo

_ENV = None


@dataclass(frozen=True)
class GoldCheck:
    name: str
    gold_steps: int
    won: bool
    score: int
    reset_s: float
    step_s: list[float] = field(default_factory=list)
    error: str | None = None


def _init_worker() -> None:
    global _ENV
    from comap_async.envs.scienceworld_env import ScienceWorldTextEnv

    _ENV = ScienceWorldTextEnv(max_steps=10_000)  # the gold sequence itself is the only limit here


def check_game(game: GameInfo) -> GoldCheck:
    """Load ``game``, replay its gold sequence, and say whether it reached score 100."""
    assert _ENV is not None, "check_game runs in a worker set up by _init_worker"
    try:
        t0 = time.perf_counter()
        result = _ENV.reset(game)
        reset_s = time.perf_counter() - t0
        gold, steps = _ENV.walkthrough(), []
        for action in gold:
            t = time.perf_counter()
            result = _ENV.step(action)
            steps.append(time.perf_counter() - t)
            if result.done:
                break
        return GoldCheck(game.name, len(gold), result.won, int(result.info["score"]), reset_s, steps)
    except Exception as exc:  # noqa: BLE001 - one broken game is reported, the check goes on
        return GoldCheck(game.name, 0, False, 0, 0.0, error=f"{type(exc).__name__}: {exc}")


def check_games(games: list[GameInfo], workers: int) -> Iterator[GoldCheck]:
    """Checks in completion order, ``workers`` simulators in parallel."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(max(1, min(workers, len(games))), initializer=_init_worker) as pool:
        yield from pool.imap_unordered(check_game, games)
