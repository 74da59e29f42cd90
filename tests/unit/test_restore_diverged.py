"""A restore by replay that does not rebuild the state (ScienceWorld is not always deterministic):
a typed error from ``envs.base.replay``, and the warm-up skips its exploration instead of failing
the whole episode (it used to: 3 of ~90 warm-up episodes in a ScienceWorld run were lost)."""

from __future__ import annotations

import asyncio

import pytest

from actors.episodes import EpisodeContext
from actors.expert_play import play_expert
from comap_async.config import load_config
from comap_async.envs.base import RestoreDiverged, StepResult, replay
from comap_async.wire.messages import Registry

PLAN = ["open door", "go to kitchen", "pick up cup", "look around"]
ACTIONS = ("look around", "open door", "go to kitchen", "pick up cup", "wait1", "inventory")


class ScriptedEnv:
    """Wins after ``wins_at`` steps whatever is played (the way a replay can finish early)."""

    def __init__(self, wins_at: int, max_steps: int = 10) -> None:
        self.wins_at, self.max_steps, self.steps, self.done = wins_at, max_steps, 0, False

    def _result(self) -> StepResult:
        won = self.steps >= self.wins_at
        expert = PLAN[self.steps] if self.steps < len(PLAN) else None
        return StepResult(f"obs {self.steps}", won, won, ACTIONS, expert, float(won))

    def reset(self, game) -> StepResult:
        self.steps, self.done = 0, False
        return self._result()

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over")
        self.steps += 1
        r = self._result()
        self.done = r.done
        return r


def test_replay_raises_when_the_episode_ends_before_the_prefix_does():
    assert replay(ScriptedEnv(wins_at=4), "g", PLAN[:3]).observation == "obs 3"
    with pytest.raises(RestoreDiverged, match="replaying 4 actions on g: the episode ended after 2"):
        replay(ScriptedEnv(wins_at=2), "g", PLAN)
    # the replay's last action ends the episode: no state to act in either (seen on power-component)
    with pytest.raises(RestoreDiverged, match="replaying 3 actions on g: the episode ended after 3"):
        replay(ScriptedEnv(wins_at=3), "g", PLAN[:3])


class AsyncScripted:
    def __init__(self, env: ScriptedEnv, diverges: bool = False) -> None:
        self.env, self.diverges = env, diverges

    async def reset(self, game):
        return self.env.reset(game)

    async def step(self, action):
        return self.env.step(action)

    async def walkthrough(self):
        return list(PLAN)

    async def restore(self, game, actions):
        if self.diverges:
            raise RestoreDiverged("replay ended early")
        return replay(self.env, game, actions)


class Game:
    name, split, task_type, path = "dev/x/var0", "dev", 1, "x:0"


def test_warmup_skips_the_exploration_of_a_diverged_restore_and_keeps_the_episode():
    cfg = load_config(None, ["actor.warmup_explore=1.0"])  # explore at every step
    sent = []

    async def emit(msg):
        sent.append(msg)

    ctx = EpisodeContext("a", cfg, None, emit, lambda state, text: frozenset({text}), Registry)
    stats = asyncio.run(
        play_expert(
            ctx,
            AsyncScripted(ScriptedEnv(wins_at=4)),
            Game(),
            "a:e1",
            branch=AsyncScripted(ScriptedEnv(wins_at=4), diverges=True),
        )
    )
    transitions = [m for m in sent if type(m).__name__ == "Transition"]
    assert stats.won and stats.steps == 4 and stats.restore_diverged == 4
    assert [t.a_exec for t in transitions] == PLAN and not any(t.explore for t in transitions)
    assert stats.metrics()["restore_diverged"] == 4.0
    # the same episode with a faithful branch explores at every step
    sent.clear()
    stats = asyncio.run(
        play_expert(
            ctx, AsyncScripted(ScriptedEnv(wins_at=4)), Game(), "a:e1", branch=AsyncScripted(ScriptedEnv(wins_at=9))
        )
    )
    assert stats.restore_diverged == 0 and sum(bool(m.explore) for m in sent if hasattr(m, "explore")) == 4
