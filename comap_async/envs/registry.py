"""The environment registry: one entry per text environment, everything the system needs from it.

An entry names its parts by import path, so this module stays light (no engine is imported until
a part is used) and an environment worker process, which starts from scratch, finds the same parts
from the name alone. Adding an environment is its own module(s) and one :func:`register` line here;
an environment outside this package is named by its spec's import path instead of a name
(``env.name: mypackage.webshop:SPEC``), so it needs no line here at all.

The parts (docs/design.md section 8):

* ``env``: the :class:`~comap_async.envs.base.TextEnv` class, created in the pool's worker processes;
* ``games``: ``discover(cfg, split) -> list[GameInfo]``, the games of a split;
* ``facts``: a module with ``parse_facts(text)``, ``next_state(facts, text)`` (the canonical facts
  behind Delta-F1 and the world-state gate; ``None`` means unreadable) and, where the environment can
  tell cheaply, ``is_readable(text)``;
* ``splits``, the one actors train on by default, the held-out one the evaluator measures and the
  evaluation splits that training must never read;
* ``wording``: the prompts' two system messages (:class:`comap_async.prompts.Wording`);
* ``scored``: whether an episode's return is a partial-progress score (0-100) that moves before
  success does, so comparisons chart the mean score rather than the success rate.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from comap_async.prompts import ALFWORLD, Wording


@dataclass(frozen=True)
class EnvSpec:
    name: str
    env: str
    """``module:Class`` of the environment (a :class:`~comap_async.envs.base.TextEnv`)."""
    games: str
    """``module:function`` returning a split's games: ``discover(cfg, split)``."""
    facts: str
    """Module with ``parse_facts``, ``next_state`` and optionally ``is_readable``."""
    splits: tuple[str, ...]
    train_split: str
    held_out_split: str
    wording: Wording
    scored: bool = False
    eval_splits: tuple[str, ...] | None = None
    """The splits kept for evaluation, which training must never read: a training process (learner,
    actor, broker) refuses a config whose ``env.split`` is one of them or is ``eval.split``
    (:meth:`comap_async.config.CoMapConfig.training_split_problem`); evaluation commands play them
    through their own ``--split``. Every split held out from the training games is one, including
    one drawn from the training distribution (ALFWorld's ``valid_train``): a score on it means
    something only while no training step has seen it. ``None``: every split but ``train_split``."""

    def __post_init__(self) -> None:
        if self.train_split not in self.splits or self.held_out_split not in self.splits:
            raise ValueError(f"environment {self.name!r}: its train and held-out splits must be among {self.splits}")
        held = self.eval_splits
        if held is None:
            held = tuple(s for s in self.splits if s != self.train_split)
            object.__setattr__(self, "eval_splits", held)  # frozen: the default is derived once, here
        if not set(held) <= set(self.splits) or self.train_split in held:
            raise ValueError(
                f"environment {self.name!r}: its evaluation splits must be among {self.splits}, "
                f"without its train split {self.train_split!r}"
            )
        if self.held_out_split not in held:
            raise ValueError(f"environment {self.name!r}: its held-out split must be one of its evaluation splits")

    def create(self, **kwargs: Any) -> Any:
        return load(self.env)(**kwargs)

    def discover(self, cfg: Any, split: str) -> list[Any]:
        return load(self.games)(cfg, split)

    def fact_parser(self) -> Callable[[str], frozenset[str] | None]:
        return importlib.import_module(self.facts).parse_facts

    def next_state(self) -> Callable[[frozenset[str], str], frozenset[str] | None]:
        return importlib.import_module(self.facts).next_state


ENVS: dict[str, EnvSpec] = {}


def register(spec: EnvSpec) -> EnvSpec:
    ENVS[spec.name] = spec
    return spec


def load(path: str) -> Any:
    """``module:attribute`` -> the attribute."""
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"{path!r} is not an import path of the form module:attribute")
    return getattr(importlib.import_module(module), attr)


def env_spec(name: str) -> EnvSpec:
    """The entry of ``name``: a registered environment, or the import path of an :class:`EnvSpec`."""
    spec = ENVS.get(name)
    if spec is not None:
        return spec
    if ":" in name:
        try:
            spec = load(name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"environment {name!r}: cannot import it ({exc})") from None
        if not isinstance(spec, EnvSpec):
            raise ValueError(f"environment {name!r} is a {type(spec).__name__}, not an EnvSpec")
        return spec
    raise ValueError(f"unknown environment {name!r}; known: {', '.join(ENVS)} (or a module:SPEC import path)")


register(
    EnvSpec(
        name="alfworld",
        env="comap_async.envs.alfworld_env:AlfworldEnv",
        games="comap_async.envs.alfworld_games:games_for_config",
        facts="comap_async.envs.alfworld_facts",
        splits=("train", "valid_seen", "valid_unseen", "valid_train"),
        train_split="train",
        held_out_split="valid_seen",
        # valid_train: other trials of train's own task folders, none of train's trials; held out too
        eval_splits=("valid_seen", "valid_unseen", "valid_train"),
        wording=ALFWORLD,
    )
)
register(
    EnvSpec(
        name="scienceworld",
        env="comap_async.envs.scienceworld_env:ScienceWorldTextEnv",
        games="comap_async.envs.scienceworld_games:games_for_config",
        facts="comap_async.envs.scienceworld_facts",
        splits=("train", "dev", "test"),
        train_split="train",
        held_out_split="dev",
        eval_splits=("dev", "test"),
        wording=Wording(
            agent=(
                "You are an agent in a text-based science environment. "
                "You act with short commands such as 'look around', 'open door to kitchen', 'go to kitchen', "
                "'pick up thermometer', 'move metal pot to stove', 'activate stove', 'use thermometer on water', "
                "'focus on water', 'wait1'."
            ),
            world=(
                "You are a world model of a text-based science environment. "
                "Given the current state and an action, you write the exact observation the environment returns."
            ),
        ),
        scored=True,
    )
)
