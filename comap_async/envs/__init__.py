"""Text environments behind one protocol (docs/design.md section 8), one registry entry each
(:mod:`comap_async.envs.registry`): ALFWorld and ScienceWorld.

Light to import: the engines (alfworld, textworld, scienceworld) load only when an environment is created,
and :func:`get_fact_parser` returns pure parsers, so the actors and the metrics can use them without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from comap_async.envs.base import GameInfo, StepResult, TextEnv
from comap_async.envs.registry import ENVS, EnvSpec, env_spec, register

if TYPE_CHECKING:
    from comap_async.config import CoMapConfig
    from comap_async.envs.pool import AsyncEnvPool

__all__ = [
    "ENVS",
    "EnvSpec",
    "GameInfo",
    "StepResult",
    "TextEnv",
    "create_env",
    "env_pool_from_config",
    "games_from_config",
    "get_fact_parser",
    "get_next_state",
    "register",
]

ENV_RESTARTS = 5
ENV_RESTART_WINDOW_S = 600.0
"""A pool built from a config replaces dead environment workers (with a backoff) up to ``ENV_RESTARTS``
times within any ``ENV_RESTART_WINDOW_S``; one more death in that time stops its owner with an error
instead of failing episodes for ever. A crash loop spends the budget in well under a minute (its
backoff sums to 15.5 s), while workers killed now and then, as by ``benchmarks/chaos_soak.py``, never do."""


def get_fact_parser(env_name: str) -> Callable[[str], frozenset[str] | None]:
    """The canonical-facts parser of an environment (``None`` from it means unreadable text)."""
    return env_spec(env_name).fact_parser()


def get_next_state(env_name: str) -> Callable[[frozenset[str], str], frozenset[str] | None]:
    """The state update of an environment's canonical facts, ``next_state(state, text)``
    (:mod:`comap_async.facts`): Delta-F1 and the world-state gate compare states, not observations."""
    return env_spec(env_name).next_state()


def create_env(env_name: str, **kwargs: Any) -> TextEnv:
    """A synchronous environment in this process (workers of the pool call this)."""
    return env_spec(env_name).create(**kwargs)


def games_from_config(cfg: "CoMapConfig", split: str | None = None) -> list[GameInfo]:
    """The configured games of ``env.split`` (or ``split``), as the environment's entry discovers
    them (task types or tasks, ``max_games`` with the run seed)."""
    return env_spec(cfg.env.name).discover(cfg, split or cfg.env.split)


def env_pool_from_config(cfg: "CoMapConfig", workers: int = 1) -> "AsyncEnvPool":
    """An (unstarted) :class:`~comap_async.envs.pool.AsyncEnvPool` for ``cfg.env``."""
    from comap_async.envs.pool import AsyncEnvPool

    return AsyncEnvPool(
        workers=workers,
        env_name=cfg.env.name,
        max_restarts=ENV_RESTARTS,
        restart_window_s=ENV_RESTART_WINDOW_S,
        max_steps=cfg.env.max_steps,
        seed=cfg.run.seed,
    )
