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
