"""The world model as a virtual environment (WebEvolver, arXiv 2504.21024, its
``data/traj_synthesizing_world_model.py``): imagined episodes that become policy training data.

After a co-evolution episode, ``actor.imagined_rollouts`` of its real states (drawn with the run
seed) each start an imagined episode of up to ``actor.imagined_depth`` steps: the policy drafts
from the state, the student world model answers, and the answer becomes the next state's
observation (the real history, then the imagined pairs; no admissible list, as the environment has
not said what it would accept there). No environment step is taken.

The filter (the issue's "stated rule"): the policy, as critic (the look-ahead's prompt: "does this
continuation bring the task closer to done?"), scores the whole imagined episode from its real
start; it is kept when P(YES) is at least ``actor.imagined_min_score`` (0 keeps every one and asks
no critic). Each kept step is one :class:`~comap_async.wire.messages.Imagined` message: the state
the policy saw and its action. The broker stores them apart (the ``imagined`` store); the learner
mixes them into the draft loss's demonstrations at ``learner.imagined_share`` in co-evolution, and
never into the world model's data (the world model would learn from its own answers).

WebEvolver's own filter is not in its released code in a form this setting can reuse; the
critic's judgement is the closest signal the policy has without a reward.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from comap_async.prompts import render_state
from comap_async.wire.messages import POLICY, WM, Imagined


async def imagine_from(ctx: Any, ep: Any, t: int, depth: int) -> list[tuple[str, str, str]]:
    """``[(state shown to the policy, its action, the world model's answer), ...]`` from real step
    ``t`` of ``ep``; shorter than ``depth`` when the policy's draft cannot be read."""
    e = ctx.cfg.env
    history, observation = list(ep.history[:t]), ep.observation_at(t)
    steps: list[tuple[str, str, str]] = []
    for _ in range(depth):
        state = render_state(ep.task, history, observation, None, e.history_k, e.show_admissible)
        action, _ = await ctx.llm.draft(state)
        if action is None:
            break
        observation = await ctx.llm.imagine(state, action)
        steps.append((state, action, observation))
        history.append((action, observation))
    return steps


async def _one(ctx: Any, ep: Any, t: int) -> tuple[int, list[tuple[str, str, str]], float | None, bool]:
    a = ctx.cfg.actor
    steps = await imagine_from(ctx, ep, t, a.imagined_depth)
    if not steps:
        return t, steps, None, False
    if a.imagined_min_score <= 0:
        return t, steps, None, True
    score = await ctx.llm.critic(steps[0][0], [(action, answer) for _, action, answer in steps])
    return t, steps, score, score is not None and score >= a.imagined_min_score


async def emit_imagined(ctx: Any, ep: Any) -> None:
    """Play ``actor.imagined_rollouts`` imagined episodes from ``ep``'s real states (concurrently:
    their calls share the server's batches) and emit the kept ones' steps."""
    a = ctx.cfg.actor
    rng = random.Random(f"{ctx.cfg.run.seed}-{ep.id}-imagined")
    starts = sorted(rng.sample(range(ep.stats.steps), min(a.imagined_rollouts, ep.stats.steps)))
    results = await asyncio.gather(*(_one(ctx, ep, t) for t in starts))
    policy_v, wm_v = ctx.llm.last_version(POLICY) or 0, ctx.llm.last_version(WM) or 0
    for t, steps, score, kept in results:
        if not kept:
            ep.stats.imagined_dropped += 1
            continue
        ep.stats.imagined_kept += 1
        for k, (state, action, _) in enumerate(steps):
            await ctx.emit(
                Imagined(
                    seq=0,
                    id=f"{ep.id}:{t}:i{k}",
                    actor=ctx.actor,
                    game=ep.game.name,
                    episode=ep.id,
                    t=t,
                    k=k,
                    goal=ep.task,
                    s=state,
                    target=action,
                    score=score,
                    policy_version=policy_v,
                    wm_version=wm_v,
                    ts=time.time(),
                )
            )
