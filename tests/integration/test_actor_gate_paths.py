"""The CoMap step's branches on a real ALFWorld game, with a scripted model (the model is the only stand-in).

The tiny random model almost never produces a readable REVISE decision, so the opened action gate is
exercised here: revisions toward the walkthrough are executed, refused ones are not.
"""

from __future__ import annotations

import pytest

from actors.episodes import EpisodeContext, play_coevolve
from actors.llm import Reflected
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import parse_facts
from comap_async.envs.pool import AsyncEnvPool
from comap_async.protocol import validate

pytestmark = pytest.mark.alfworld


class ScriptedLLM:
    """Drafts 'look'; reflects with a confident revision to the walkthrough action on even steps."""

    def __init__(self, plan: list[str]) -> None:
        self.plan, self.t, self.imagined = plan, 0, []

    async def draft(self, state):
        return "look", None

    async def imagine(self, state, action):
        self.imagined.append(action)
        return f"You imagine doing {action}."

    async def teacher(self, state, action, real_next):
        return real_next

    async def reflect(self, state, a_draft, s_hat):
        t, self.t = self.t, self.t + 1
        target = self.plan[min(t, len(self.plan) - 1)]
        if t % 2 == 0:
            return Reflected("REVISE", target, 0.9, 0.95, None)
        return Reflected("REVISE", target, 0.9, 0.2, None)  # confident decision, unsure action: refused


async def test_gate_opens_and_closes_on_a_real_game(valid_seen, alfworld_data):
    game = sorted(valid_seen, key=lambda g: g.name)[0]
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "env.max_steps=6"])
    sent: list[dict] = []

    async def emit(msg):
        sent.append(validate({**msg, "v": 1, "seq": len(sent)}))

    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=6) as pool:
        env = pool.env()
        await env.reset(game)
        llm = ScriptedLLM(await env.walkthrough())
        ctx = EpisodeContext("test", cfg, llm, emit, parse_facts, lambda: {"versions": {"policy": 3, "wm": 2}})
        stats = await play_coevolve(ctx, env, game, "test:e1")
    transitions = [m for m in sent if m["type"] == "transition"]
    assert transitions and sent[-1]["type"] == "episode"
    for tr in transitions:
        if tr["t"] % 2 == 0:  # revision executed; the world model imagined the executed action too
            assert tr["a_exec"] == tr["a_ref"] != "look"
            assert tr["s_hat_exec"] == f"You imagine doing {tr['a_exec']}." != tr["s_hat"]
        else:  # low q_ref: the draft is executed and its imagined state reused
            assert tr["a_exec"] == "look" and tr["s_hat_exec"] == tr["s_hat"]
        assert (tr["policy_version"], tr["wm_version"]) == (3, 2)
        assert tr["s_hat_teacher"] == tr["s_next"]
    assert stats.revisions == len([t for t in transitions if t["t"] % 2 == 0])
    assert "delta_f1" in sent[-1]["metrics"]


class PlanFollower:
    """Follows the walkthrough, either by drafting it or by revising a 'look' draft toward it."""

    def __init__(self, plan: list[str], revise_to_plan: bool) -> None:
        self.plan, self.t, self.revise_to_plan = plan, 0, revise_to_plan

    def _next(self) -> str:
        return self.plan[min(self.t, len(self.plan) - 1)]

    async def draft(self, state):
        return ("look" if self.revise_to_plan else self._next()), None

    async def imagine(self, state, action):
        return "Nothing happens."

    async def teacher(self, state, action, real_next):
        return real_next

    async def reflect(self, state, a_draft, s_hat):
        target, self.t = self._next(), self.t + 1
        if self.revise_to_plan:  # a confident revision to the walkthrough: executed
            return Reflected("REVISE", target, 0.9, 0.95, None)
        return Reflected("REVISE", "look", 0.9, 0.2, None)  # a bad revision the gate refuses


async def test_reflection_metrics_judge_proposed_revisions_by_suffix_rollouts(valid_seen, alfworld_data):
    """Horizon 1: only the winning last step separates the branches. Revising 'look' to the winning
    action is an executed, useful revision; revising the winning action to 'look' is a harmful one
    that the gate blocks; every other proposal is neutral."""
    from actors.evaluate import reflection_summary

    game = sorted(valid_seen, key=lambda g: g.name)[1]
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "actor.suffix_horizon=1"])

    async def emit(msg):
        return None

    outcomes = []
    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
        env, branch = pool.env(), pool.env()
        await env.reset(game)
        plan = await env.walkthrough()
        for revise_to_plan in (True, False):
            ctx = EpisodeContext("test", cfg, PlanFollower(plan, revise_to_plan), emit, parse_facts, lambda: {})
            stats = await play_coevolve(ctx, env, game, f"test:r{revise_to_plan}", eval_mode=True, branch=branch)
            assert stats.won and stats.steps == len(plan)
            assert len(stats.revision_outcomes) == len(plan)  # every step proposed a different action
            assert stats.revision_outcomes[-1] == (revise_to_plan, "better" if revise_to_plan else "worse")
            assert {o for _, o in stats.revision_outcomes[:-1]} == {"same"}
            outcomes += stats.revision_outcomes
    summary = reflection_summary(outcomes, horizon=1)
    n = len(plan)
    assert summary["proposed"] == 2 * n and summary["executed"] == n
    assert (summary["executed_better"], summary["executed_same"], summary["blocked_worse"], summary["blocked_same"]) == (1, n - 1, 1, n - 1)
    assert summary["urr"] == pytest.approx(1 / n) and summary["hrr"] == 0.0 and summary["brp"] == 1.0
