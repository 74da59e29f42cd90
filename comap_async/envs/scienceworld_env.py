"""ScienceWorld behind the :class:`~comap_async.envs.base.TextEnv` protocol.

One simulator (a JVM, heap capped at 1 GB) per environment object, started at its first ``reset``
and reused for every later game: loading another task or variation costs ~0.1-0.3 s, a step
~36-45 ms (median, with the valid actions); gold sequences come from one more simulator per
process (:func:`~comap_async.envs.scienceworld_games.gold_sequence`, cached per game).
Replaying a prefix is not exact for about half the tasks in scienceworld 1.2.3 (object order in
listings, a thermometer's reading, plant traits differ between runs), so ``restore`` rebuilds a
close state, not always the same one. Success is the task's score reaching 100. An episode's rewards add up to
its final score / 100 on the benchmark's 0-100 scale (:func:`task_points`): counted from 0, not from the points a
task may already hold at reset, and a failed task (the simulator's -100 after a wrong ``focus on``) is 0. The gold
action sequence is the expert (walkthrough): its next action is offered while the episode has followed it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from comap_async.envs.base import GameInfo, StepResult, replay
from comap_async.envs.scienceworld_games import SIMPLIFICATION, gold_sequence, parse_game_path, start_simulator


def task_points(score: int) -> int:
    """The simulator's score on the 0-100 scale the benchmark reports: -100 marks a failed task, which
    counts 0 (its partial progress is lost with the failure, as the simulator says)."""
    return max(0, score)


class ScienceWorldTextEnv:
    def __init__(self, max_steps: int = 50, simplification: str = SIMPLIFICATION, seed: int = 0) -> None:
        self.max_steps = max_steps
        self.simplification = simplification
        self._env: Any = None
        self._loaded: str | None = None
        self._gold: list[str] = []
        self._on_gold = True
        self.steps = 0
        self.done = False
        self.score = 0
        self.task = ""

    def reset(self, game: GameInfo | str) -> StepResult:
        path = game.path if isinstance(game, GameInfo) else str(game)
        task, variation = parse_game_path(path)
        if self._env is None:
            self._env = start_simulator()
        if self._loaded != path:
            self._env.load(task, variation, self.simplification)
            self._gold = gold_sequence(task, variation, self.simplification)
            self._loaded = path
        observation, info = self._env.reset()
        self.task = self._env.get_task_description().strip()
        self.steps, self.done, self.score, self._on_gold = 0, False, int(info.get("score") or 0), True
        return self._result(observation, info, reward=0.0, extra={"task": self.task})

    def step(self, action: str) -> StepResult:
        if self._env is None or self._loaded is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            raise RuntimeError(f"the episode is over (score={self.score}, steps={self.steps}); reset first")
        observation, _, completed, info = self._env.step(action)
        if self._on_gold and (self.steps >= len(self._gold) or self._gold[self.steps] != action):
            self._on_gold = False
        paid = task_points(self.score) if self.steps else 0  # the points at reset are paid by the first step
        self.steps += 1
        score = int(info.get("score") or 0)
        reward, self.score = (task_points(score) - paid) / 100.0, score
        # completed also means failed (a negative score): the episode is over either way
        self.done = score >= 100 or bool(completed) or self.steps >= self.max_steps
        return self._result(observation, info, reward, {"truncated": self.done and score < 100 and not completed})

    def restore(self, game: GameInfo | str, actions: Sequence[str]) -> StepResult:
        """Reset and replay ``actions`` (the step limit does not cut a replay short)."""
        return replay(self, game, actions)

    def walkthrough(self) -> list[str]:
        """The current game's gold action sequence."""
        if self._loaded is None:
            raise RuntimeError("walkthrough() before reset()")
        return list(self._gold)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
            self._loaded = None

    def _result(self, observation: str, info: dict[str, Any], reward: float, extra: dict[str, Any]) -> StepResult:
        expert = self._gold[self.steps] if self._on_gold and self.steps < len(self._gold) else None
        return StepResult(
            observation=observation.strip(),
            won=self.score >= 100,
            done=self.done,
            admissible=tuple(sorted(info.get("valid") or ())),
            expert_action=expert,
            reward=reward,
            info={"steps": self.steps, "score": self.score, **({"expert_source": "gold"} if expert else {}), **extra},
            location=str(info.get("look") or "").strip(),
        )
