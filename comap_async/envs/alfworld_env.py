"""ALFWorld on TextWorld's PDDL engine (text only), with the handcoded expert and restore by replay.

The engine is wrapped the way the ``alfworld`` package does it (``AlfredDemangler`` names the
entities ``apple 1``; ``AlfredInfos`` keeps the game file) and the handcoded expert is driven
like ``AlfredExpert`` with ``expert_type="handcoded"``: it observes the intro, then after each
command proposes the next one, ``look`` when its proposal is not admissible. Off its own path
the handcoded policy sometimes crashes; it is then dropped for the episode (``expert_error`` in
the step's info) and, while the episode still follows the game's walkthrough, the walkthrough's
next command is the expert action (``expert_source`` says which). The Fast Downward planner
expert is never used (it can run for minutes).

This class is synchronous and process-global state heavy (TextWorld's translation touches
``sys.argv``/``sys.stdout``; the speed-up caches patch modules); async code uses it through
:mod:`comap_async.envs.pool`, which runs it in worker processes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from comap_async.envs.base import GameInfo, StepResult, replay

TASK_PREFIX = "Your task is to: "


def task_of(intro: str) -> str:
    """The task sentence of an intro observation (``look at alarmclock under the desklamp.``)."""
    i = intro.find(TASK_PREFIX)
    if i < 0:
        raise ValueError(f"no {TASK_PREFIX!r} in the intro observation: {intro[:200]!r}")
    return intro[i + len(TASK_PREFIX) :].strip().splitlines()[0]


class RestoreMismatch(RuntimeError):
    """Replaying an action prefix did not reproduce the recorded state."""


class AlfworldEnv:
    """One ALFWorld game at a time; ``reset`` with another game loads it (cached per process)."""

    def __init__(self, max_steps: int = 50, expert: bool = True, speedups: bool = True, seed: int = 0) -> None:
        if speedups:
            from comap_async.envs import textworld_speedups

            textworld_speedups.install()
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        self.max_steps = max_steps
        self.expert_enabled = expert
        self._textworld = textworld
        self._wrappers = [AlfredDemangler(shuffle=False), AlfredInfos]
        # the handcoded expert reads engine facts; the planner's policy_commands are never asked for
        self._infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=expert, extras=["gamefile"])
        self._env: Any = None
        self._game_path: str | None = None
        self._expert: Any = None
        # the expert breaks loops with the global `random`; a private state per env keeps
        # its choices reproducible however many envs share the process
        self._expert_rng_state = random.Random(seed).getstate()
        self._seed = seed
        self._state: Any = None
        self._prev_command = ""
        self._walkthrough: list[str] = []
        self._on_walkthrough = False
        self.steps = 0
        self.task = ""
        self.done = True

    # ------------------------------------------------------------------ episode API
    def reset(self, game: GameInfo | str) -> StepResult:
        path = game.path if isinstance(game, GameInfo) else str(game)
        if self._env is None:
            self._env = self._textworld.start(path, self._infos, wrappers=self._wrappers)
        elif path != self._game_path:
            self._env.load(path)
        self._game_path = path
        self._state = self._env.reset()
        self._prev_command = ""
        self._walkthrough = self.walkthrough()
        self._on_walkthrough = True
        self.steps = 0
        self.done = False
        self.task = task_of(self._state.feedback)
        self._expert_rng_state = random.Random(f"{self._seed}:{path}").getstate()
        expert_action, info = self._expert_reset(path)
        info["task"] = self.task
        return self._result(expert_action, info)

    def step(self, action: str) -> StepResult:
        if self._state is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            raise RuntimeError(f"the episode is over (won={bool(self._state['won'])}, steps={self.steps}); reset first")
        self._state, _, _ = self._env.step(action)
        self._prev_command = str(action)
        if self._on_walkthrough and (self.steps >= len(self._walkthrough) or self._walkthrough[self.steps] != action):
            self._on_walkthrough = False
        self.steps += 1
        expert_action, info = self._expert_next()
        self.done = bool(self._state["won"]) or self.steps >= self.max_steps
        info["truncated"] = self.done and not self._state["won"]
        return self._result(expert_action, info)

    def restore(self, game: GameInfo | str, actions: Sequence[str]) -> StepResult:
        """Reset and replay ``actions`` (the step limit does not cut a replay short)."""
        return replay(self, game, actions)

    def restore_verified(self, game: GameInfo | str, actions: Sequence[str], expected: StepResult) -> StepResult:
        """:meth:`restore`, raising :class:`RestoreMismatch` unless observation and commands match."""
        result = self.restore(game, actions)
        if result.observation != expected.observation or result.admissible != expected.admissible:
            raise RestoreMismatch(
                f"replaying {len(actions)} actions of {game} gave {result.observation[:120]!r}, "
                f"expected {expected.observation[:120]!r}"
            )
        return result

    def walkthrough(self) -> list[str]:
        """The current game's recorded winning command sequence."""
        if self._env is None:
            raise RuntimeError("walkthrough() before reset()")
        return list(self._env.unwrapped.walkthrough or [])

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    # ------------------------------------------------------------------ internals
    def _result(self, expert_action: str | None, info: dict[str, Any]) -> StepResult:
        won = bool(self._state["won"])
        info["steps"] = self.steps
        return StepResult(
            observation=self._state.feedback,
            won=won,
            done=self.done,
            admissible=tuple(self._state["admissible_commands"]),
            expert_action=expert_action,
            reward=1.0 if won else 0.0,
            info=info,
        )

    def _expert_reset(self, path: str) -> tuple[str | None, dict[str, Any]]:
        if not self.expert_enabled:
            return None, {}
        from alfworld.agents.expert import HandCodedTWAgent

        # alfworld's AlfredExpert builds its handcoded agent with this step budget
        self._expert = HandCodedTWAgent(max_steps=200)
        self._expert.reset(path)
        self._expert.observe(self._state.feedback)
        # the handcoded policy's first subgoal is to look around, as in AlfredExpert
        return "look", {"expert_source": "handcoded"}

    def _expert_next(self) -> tuple[str | None, dict[str, Any]]:
        if not self.expert_enabled:
            return None, {}
        info: dict[str, Any] = {}
        if self._expert is not None:
            outer = random.getstate()
            random.setstate(self._expert_rng_state)
            try:
                proposal = self._expert.act(self._state, 0, self._state["won"], self._prev_command)
            except Exception as exc:  # noqa: BLE001 - third-party heuristics, reported below
                # off its own path the handcoded policy can crash (e.g. IndexError on an empty
                # choice); its internal state is then unusable, so it is dropped for the episode
                self._expert = None
                info["expert_error"] = f"{type(exc).__name__}: {exc}"
            else:
                if proposal in self._state["admissible_commands"]:
                    return proposal, {"expert_source": "handcoded"}
                # AlfredExpert's fallback for an inadmissible proposal
                return "look", {"expert_source": "handcoded", "expert_fallback": proposal}
            finally:
                self._expert_rng_state = random.getstate()
                random.setstate(outer)
        nxt = self._walkthrough_next()
        if nxt is not None:
            info["expert_source"] = "walkthrough"
        return nxt, info

    def _walkthrough_next(self) -> str | None:
        """The walkthrough's next command while the episode has followed it exactly."""
        walk = self._walkthrough
        if self._on_walkthrough and self.steps < len(walk):
            return walk[self.steps]
        return None
