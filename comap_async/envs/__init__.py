"""Text environments behind one protocol (docs/design.md section 8): ALFWorld and ScienceWorld.

Light to import: the engines (alfworld, textworld, scienceworld) load only when an environment is created,
and :func:`get_fact_parser` returns pure parsers, so the broker can use it without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from comap_async.envs.base import GameInfo, StepResult, TextEnv

if TYPE_CHECKING:
    from comap_async.config import CoMapConfig
    from comap_async.envs.pool import AsyncEnvPool

__all__ = [
    "GameInfo",
    "StepResult",
    "TextEnv",
    "create_env",
    "env_pool_from_config",
    "games_from_config",
    "get_fact_parser",
    "get_next_state",
]

ENV_NAMES = ("alfworld", "scienceworld")


def get_fact_parser(env_name: str) -> Callable[[str], frozenset[str] | None]:
    """The canonical-facts parser of an environment (``None`` from it means unreadable text)."""
    if env_name == "alfworld":
        from comap_async.envs.alfworld_facts import parse_facts

        return parse_facts
    if env_name == "scienceworld":
        from comap_async.envs.scienceworld_facts import parse_facts as parse_scienceworld

        return parse_scienceworld
    raise ValueError(f"no fact parser for environment {env_name!r}; known: {', '.join(ENV_NAMES)}")


def get_next_state(env_name: str) -> Callable[[frozenset[str], str], frozenset[str] | None]:
    """The state update of an environment's canonical facts, ``next_state(state, text)``
    (:mod:`comap_async.facts`): Delta-F1 and the world-state gate compare states, not observations."""
    if env_name == "alfworld":
        from comap_async.envs.alfworld_facts import next_state

        return next_state
    if env_name == "scienceworld":
        from comap_async.envs.scienceworld_facts import next_state as scienceworld_next_state

        return scienceworld_next_state
    raise ValueError(f"no fact state for environment {env_name!r}; known: {', '.join(ENV_NAMES)}")


def create_env(env_name: str, **kwargs: Any) -> TextEnv:
    """A synchronous environment in this process (workers of the pool call this)."""
    if env_name == "alfworld":
        from comap_async.envs.alfworld_env import AlfworldEnv

        return AlfworldEnv(**kwargs)
    if env_name == "scienceworld":
        from comap_async.envs.scienceworld_env import ScienceWorldTextEnv

        return ScienceWorldTextEnv(**kwargs)
    raise ValueError(f"unknown environment {env_name!r}; known: {', '.join(ENV_NAMES)}")


def games_from_config(cfg: "CoMapConfig", split: str | None = None) -> list[GameInfo]:
    """The configured games: ``env.split`` (or ``split``), task types (ScienceWorld: tasks and
    variations per task) and ``max_games`` with the run seed."""
    if cfg.env.name == "scienceworld":
        from comap_async.envs import scienceworld_games

        return scienceworld_games.discover_games(split or cfg.env.split, tasks=cfg.env.tasks,
                                                 per_task=cfg.env.per_task, max_games=cfg.env.max_games,
                                                 seed=cfg.run.seed)
    from comap_async.envs.alfworld_games import discover_games, resolve_data_root

    return discover_games(
        resolve_data_root(cfg.alfworld_data),
        split or cfg.env.split,
        task_types=cfg.env.task_types,
        max_games=cfg.env.max_games,
        seed=cfg.run.seed,
    )


def env_pool_from_config(cfg: "CoMapConfig", workers: int = 1) -> "AsyncEnvPool":
    """An (unstarted) :class:`~comap_async.envs.pool.AsyncEnvPool` for ``cfg.env``."""
    from comap_async.envs.pool import AsyncEnvPool

    return AsyncEnvPool(workers=workers, env_name=cfg.env.name, max_restarts=cfg.actor.env_restarts,
                        max_steps=cfg.env.max_steps, seed=cfg.run.seed)
