"""ScienceWorld's games: (task, variation) pairs of the benchmark's train / dev / test splits.

The simulator (a JVM started by the ``scienceworld`` package, Java 17) knows the 30 tasks and each
task's variation split; listing them costs one JVM start (~1.4 s here). A game is named
``<split>/<task>/var<N>`` and its ``path`` is ``<task>:<N>``, which the environment loads.
"""

from __future__ import annotations

import os
import random
import shutil
from functools import lru_cache

from comap_async.envs.base import GameInfo
from comap_async.envs.registry import ENVS
from comap_async.errors import CommandError

SPLITS = ENVS["scienceworld"].splits

SIMPLIFICATION = "easy"
"""The simplifications most agent papers play with (``noElectricalAction, openDoors,
selfWateringFlowerPots, teleportAction``); every task's gold sequence wins under it."""
HOW_TO_INSTALL = (
    "ScienceWorld needs the `scienceworld` package (`pip install scienceworld`, in this project's "
    "dependencies) and Java 17 or newer on PATH (Debian: `apt-get install openjdk-17-jre-headless`)"
)


class ScienceWorldError(CommandError, RuntimeError):
    """The simulator cannot run here (package or Java missing), or a game name is not one of its games."""


JVM_HEAP = "-Xmx1g"
"""The simulator's heap cap: without one the JVM grew to 2.5-4.1 GB over a few dozen episodes here,
with it stayed at ~0.9 GB (no errors). A ``-Xmx`` in ``$JAVA_TOOL_OPTIONS`` takes precedence."""


def start_simulator(step_limit: int = 1_000_000):
    """A ``scienceworld.ScienceWorldEnv`` (one JVM), or :class:`ScienceWorldError` saying what is missing.

    ``step_limit`` is the simulator's own limit, in its ticks (``wait`` costs 11): the environment
    counts agent steps itself, so this one is set out of the way."""
    if shutil.which("java") is None:
        raise ScienceWorldError(f"no `java` on PATH; {HOW_TO_INSTALL}")
    try:
        from scienceworld import ScienceWorldEnv
    except ImportError as exc:
        raise ScienceWorldError(f"cannot import scienceworld ({exc}); {HOW_TO_INSTALL}") from None
    before = os.environ.get("JAVA_TOOL_OPTIONS")
    if "-Xmx" not in (before or ""):  # the package starts java itself: the only way to give it options
        os.environ["JAVA_TOOL_OPTIONS"] = f"{before} {JVM_HEAP}" if before else JVM_HEAP
    try:
        return ScienceWorldEnv("", envStepLimit=step_limit)
    finally:
        if before is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = before


_gold_simulator = None
_gold: dict[tuple[str, int, str], tuple[str, ...]] = {}


def gold_sequence(task: str, variation: int, simplification: str) -> list[str]:
    """The gold action sequence of a game, from a simulator of its own (one per process, cached).

    Generating gold paths is sticky in a simulator: once asked for one, every later ``reset``
    generates it again (measured: 11.9 s instead of 0.13 s for a genetics task), so the playing
    simulator never asks."""
    global _gold_simulator
    key = (task, variation, simplification)
    if key not in _gold:
        if _gold_simulator is None:
            _gold_simulator = start_simulator()
        _gold_simulator.load(task, variation, simplification, generateGoldPath=True)
        _gold[key] = tuple(_gold_simulator.get_gold_action_sequence())
    return list(_gold[key])


@lru_cache(maxsize=1)
def task_variations() -> dict[str, dict[str, tuple[int, ...]]]:
    """``{task: {split: variation indices}}`` for the 30 tasks, in the benchmark's task order."""
    env = start_simulator()
    try:
        out = {}
        for task in env.task_names:
            env.load(task, 0, "")
            out[task] = {
                "train": tuple(env.get_variations_train()),
                "dev": tuple(env.get_variations_dev()),
                "test": tuple(env.get_variations_test()),
            }
        return out
    finally:
        env.close()


def parse_game_path(path: str) -> tuple[str, int]:
    """``"boil:14"`` -> ``("boil", 14)``."""
    task, sep, var = path.rpartition(":")
    if not sep or not task or not var.isdigit():
        raise ScienceWorldError(f"not a ScienceWorld game path (task:variation): {path!r}")
    return task, int(var)


def discover_games(
    split: str, tasks: list[str] | None = None, per_task: int | None = None, max_games: int | None = None, seed: int = 0
) -> list[GameInfo]:
    """The games of ``split``: every variation of the chosen ``tasks`` (all 30 by default), or
    ``per_task`` of each drawn with ``seed``; then at most ``max_games`` spread over the tasks."""
    from comap_async.envs.base import spread_sample

    if split not in SPLITS:
        raise ScienceWorldError(f"unknown ScienceWorld split {split!r}; choose one of {', '.join(SPLITS)}")
    table = task_variations()
    unknown = [t for t in tasks or [] if t not in table]
    if unknown:
        raise ScienceWorldError(f"unknown ScienceWorld task(s) {', '.join(unknown)}; known: {', '.join(table)}")
    games = []
    for index, task in enumerate(table, start=1):
        if tasks and task not in tasks:
            continue
        variations = list(table[task][split])
        if per_task is not None and per_task < len(variations):
            variations = sorted(random.Random(f"{seed}:{split}:{task}").sample(variations, per_task))
        games += [
            GameInfo(path=f"{task}:{v}", split=split, task_type=index, name=f"{split}/{task}/var{v}")
            for v in variations
        ]
    return spread_sample(games, max_games, seed)


def games_for_config(cfg, split: str) -> list[GameInfo]:
    """The registry's ``games`` part: ``split``'s variations of ``env.tasks`` (``env.per_task`` of
    each), at most ``env.max_games``, drawn with the run seed."""
    return discover_games(
        split, tasks=cfg.env.tasks, per_task=cfg.env.per_task, max_games=cfg.env.max_games, seed=cfg.run.seed
    )
