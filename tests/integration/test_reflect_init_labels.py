"""Reflection-mode initialisation labels on a real ALFWorld game (docs/design.md section 11).

The model is the only stand-in: a scripted policy drafts the walkthrough's action on even steps
(keep samples) and ``look`` on odd ones. Both branches run under the game's expert until the
episode ends, so the expert branch of a ``look`` detour wins in fewer steps: ``y = 1``. With the
old 5-step horizon neither branch of an early state could reach the goal and the label was 0.
"""

from __future__ import annotations

import pytest

from actors.episodes import EpisodeContext
from actors.expert_play import play_reflect_init
from actors.llm import Draft
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import next_state
from comap_async.envs.pool import AsyncEnvPool
from comap_async.wire.messages import Registry
from comap_async.wire.protocol import as_map, validate

pytestmark = pytest.mark.alfworld


class AlternatingDrafts:
    def __init__(self, plan: list[str]) -> None:
        self.plan, self.t = plan, 0

    async def draft(self, state):
        t, self.t = self.t, self.t + 1
        return (self.plan[t] if t % 2 == 0 else "look"), None

    async def draft_scored(self, state, admissible=None):
        return Draft(*await self.draft(state))


async def reflect_init_samples(valid_seen, alfworld_data, *overrides: str, long_enough: int = 0):
    """Reflection-mode initialisation of the first ``valid_seen`` game whose walkthrough is longer than
    ``long_enough``, drafted by :class:`AlternatingDrafts`: (the reflection samples the outbox would send,
    everything it would send, the episode's stats, the walkthrough, the observation after each of its steps)."""
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", *overrides])
    sent: list[dict] = []

    async def emit(msg):
        msg.seq = len(sent)
        sent.append(as_map(validate(msg)))  # what the outbox would send

    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
        env, branch = pool.env(), pool.env()
        for game in sorted(valid_seen, key=lambda g: g.name):
            await env.reset(game)
            plan = await env.walkthrough()
            if len(plan) > long_enough:
                break
        ctx = EpisodeContext("test", cfg, AlternatingDrafts(plan), emit, next_state, Registry)
        stats = await play_reflect_init(ctx, env, branch, game, "test:ri")
        observations = [(await env.reset(game)).observation] + [(await env.step(a)).observation for a in plan]
    return [m for m in sent if m["type"] == "reflection"], sent, stats, plan, observations


async def test_labels_follow_the_branches_to_the_episode_end(valid_seen, alfworld_data):
    # long enough that a 5-step horizon cannot see the win from the start
    samples, sent, stats, plan, observations = await reflect_init_samples(valid_seen, alfworld_data, long_enough=6)
    assert stats.won and len(samples) == len(plan)  # every demonstration state, equal drafts included
    assert samples[0]["target"] == plan[0] != "look"  # the demonstration is the walkthrough: no leading look
    for t, r in enumerate(samples):
        if t % 2 == 0:  # the draft is the expert action: a keep sample, not skipped
            assert (r["y"], r["label"], r["target"], r["a_draft"]) == (0, "equal_draft", plan[t], plan[t])
            assert r["s_bar"] == observations[t + 1]
        else:  # 'look' costs a step at best: both branches win, the expert's in fewer steps
            assert (r["y"], r["label"], r["target"], r["a_draft"]) == (1, "expert_sooner", plan[t], "look")
    assert stats.labels == {"equal_draft": (len(plan) + 1) // 2, "expert_sooner": len(plan) // 2}
    assert sent[-1]["type"] == "episode"


async def test_with_pairs_each_revise_sample_comes_with_the_expert_draft_as_keep(valid_seen, alfworld_data):
    samples, _, stats, plan, observations = await reflect_init_samples(
        valid_seen, alfworld_data, "actor.reflect_init_pairs=true"
    )
    revise = [r for r in samples if r["y"] == 1]
    pairs = {r["id"]: r for r in samples if r["id"].endswith(":rp")}
    assert revise and len(pairs) == len(revise)
    for r in revise:  # the same state, the expert's action as the draft, its real outcome, keep
        p = pairs[r["id"] + "p"]
        t = int(r["id"].split(":")[-2])
        assert (p["s"], p["a_draft"], p["target"], p["y"], p["label"]) == (r["s"], plan[t], plan[t], 0, "equal_draft")
        assert p["s_bar"] == observations[t + 1] and r["a_draft"] == "look"
    assert stats.labels == {"equal_draft": (len(plan) + 1) // 2 + len(revise), "expert_sooner": len(revise)}


async def test_with_the_papers_label_a_detour_that_still_wins_is_kept(valid_seen, alfworld_data):
    """``method.reflect_init_label: paper``: the same ``look`` detours, whose branches both win, are KEEP samples
    (``not_better``), their draft the target; the drafts equal to the expert's action are as before."""
    samples, _, stats, plan, _ = await reflect_init_samples(
        valid_seen, alfworld_data, "method.reflect_init_label=paper"
    )
    assert len(samples) == len(plan) >= 2
    for t, r in enumerate(samples):
        if t % 2 == 0:
            assert (r["y"], r["label"], r["target"]) == (0, "equal_draft", plan[t])
        else:
            assert (r["y"], r["label"], r["target"], r["a_draft"]) == (0, "not_better", "look", "look")
    assert stats.labels == {"equal_draft": (len(plan) + 1) // 2, "not_better": len(plan) // 2}
