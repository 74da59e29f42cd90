"""The world model as a virtual environment (WebEvolver, arXiv 2504.21024, its
``data/traj_synthesizing_world_model.py``): imagined episodes that become policy training data.

In each co-evolution episode, ``actor.imagined_rollouts`` of its real states (steps drawn with the
run seed) each start an imagined episode of up to :data:`DEPTH` steps: the policy drafts
from the state, the student world model answers, and the answer becomes the next state's
observation (the real history, then the imagined pairs; no admissible list, as the environment has
not said what it would accept there). No environment step is taken. A rollout starts when the real
episode reaches its drawn step and runs beside it (their calls share the server's batches), and
its steps go out when it ends: on a CPU a 50-step episode takes longer than a 20-minute fork, and
rollouts held back to the episode's end reached no learner there. Steps drawn past an episode that
ended early start, at its end, from played steps not used yet.

The filter (the issue's "stated rule"): the policy, as critic (the look-ahead's prompt: "does this
continuation bring the task closer to done?"), scores the whole imagined episode from its real
start; it is kept when P(YES) is at least :data:`MIN_SCORE` (0 would keep every one and ask no
critic). Each kept step is one :class:`~comap_async.wire.messages.Imagined` message: the state
the policy saw and its action; in the turns form (``env.draft_turns``) each kept episode is one
:class:`~comap_async.wire.messages.TurnDemos` path (``imagined``), the real turns as context and the
imagined actions as targets, trained as the warm-up's paths are. The broker stores them apart (the
``imagined`` store); the learner mixes them into the draft loss's demonstrations at
``comap_async.method.phases.IMAGINED_DEMO_SHARE`` in co-evolution, and never into the world model's data (the
world model would learn from its own answers).

WebEvolver's own filter is not in its released code in a form this setting can reuse; the
critic's judgement is the closest signal the policy has without a reward.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from comap_async.prompts import Conversation, render_state, turns_of
from comap_async.prompts.template import FIT_LEFT_OUT_TURNS
from comap_async.wire.messages import POLICY, WM, Imagined, TurnDemos

DEPTH = 3
"""Steps of an imagined episode (the policy's action and the world model's answer each)."""
MIN_SCORE = 0.5
"""The filter: an imagined episode is kept when the policy, as critic, scores it at least this (P(YES)
that it brings the task closer to done, the look-ahead's critic); 0 keeps every one without asking the
critic (at 0.5 one of 16 was kept in a fork, at 0 all were: docs/findings.md)."""


async def imagine_from(ctx: Any, ep: Any, t: int, depth: int) -> list[tuple[str, str, str]]:
    """``[(state s_t, the policy's action, the world model's answer), ...]`` from real step ``t`` of
    ``ep``; shorter than ``depth`` when the policy's draft cannot be read. The draft sees what it sees in
    a real step: ``s_t``, or with ``env.draft_turns`` the episode's real turns to ``t`` and the imagined
    ones; the world model sees ``s_t`` or (``env.wm_turns``) those turns, the critic ``s_t``."""
    e = ctx.cfg.env
    real = tuple(ep.history[:t])
    history, observation = list(real), ep.observation_at(t)
    steps: list[tuple[str, str, str]] = []
    location = ep.location_at(t)  # where the real step was: an imagined step's room is not known
    for _ in range(depth):
        state = render_state(ep.task, history, observation, None, e.history_k, e.show_admissible, location)
        imagined = tuple((a, o) for _, a, o in steps)
        seen = Conversation(ep.task, ep.first_observation, (*real, *imagined)) if e.draft_turns else state
        action, _ = await ctx.llm.draft(seen)
        if action is None:
            break
        observation = await ctx.llm.imagine(state, action, turns_of(seen))
        steps.append((state, action, observation))
        history.append((action, observation))
    return steps


def turns_path(ctx: Any, ep: Any, t: int, steps: list[tuple[str, str, str]], score: float | None) -> TurnDemos:
    """An imagined episode in the turns form as one path: the real turns to ``t`` (context; the oldest
    left out, in the actors' steps of ``FIT_LEFT_OUT_TURNS``, while the whole would pass
    ``inference.max_prompt_tokens``, where the learner would end the path before its imagined actions), then
    the imagined actions (targets) with the world model's answers."""
    real, imagined = list(ep.history[:t]), [(a, o) for _, a, o in steps]
    prompts, limit = ctx.llm.prompts, ctx.cfg.inference.max_prompt_tokens
    count = getattr(prompts, "count_tokens", None)
    while real and count is not None:
        whole = Conversation(ep.task, ep.first_observation, (*real, *imagined))
        if count(prompts.turns_prompt(whole, fit=False)) <= limit:
            break
        real = real[FIT_LEFT_OUT_TURNS:]
    policy_v, wm_v = ctx.llm.last_version(POLICY) or 0, ctx.llm.last_version(WM) or 0
    return TurnDemos(
        seq=0,
        id=f"{ep.id}:{t}:i",
        actor=ctx.actor,
        game=ep.game.name,
        episode=ep.id,
        goal=ep.task,
        first=ep.first_observation,
        turns=[*real, *imagined],
        targets=[False] * len(real) + [True] * len(imagined),
        imagined=True,
        score=score,
        policy_version=policy_v,
        wm_version=wm_v,
        ts=time.time(),
    )


class ImaginedRollouts:
    """The imagined episodes of one real episode: :meth:`at` each real step, :meth:`finish` at its
    end (before the episode's own message, whose metrics count them), :meth:`cancel` if it fails."""

    def __init__(self, ctx: Any, ep: Any) -> None:
        self.ctx, self.ep = ctx, ep
        self.rng = random.Random(f"{ctx.cfg.run.seed}-{ep.id}-imagined")
        horizon = ctx.cfg.env.max_steps
        self.planned = set(self.rng.sample(range(horizon), min(ctx.cfg.actor.imagined_rollouts, horizon)))
        self.started: set[int] = set()
        self.tasks: list[asyncio.Future] = []

    def at(self, t: int) -> None:
        """The real episode is at step ``t``: its state is known, its action not yet taken."""
        if t in self.planned and t not in self.started:
            self._start(t)

    def _start(self, t: int) -> None:
        self.started.add(t)
        self.tasks.append(asyncio.ensure_future(_play_and_emit(self.ctx, self.ep, t)))

    async def finish(self) -> None:
        late = len(self.planned - self.started)
        free = [t for t in range(self.ep.stats.steps) if t not in self.started]
        for t in sorted(self.rng.sample(free, min(late, len(free)))):
            self._start(t)
        try:
            await asyncio.gather(*self.tasks)
        finally:
            self.cancel()

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def _play_and_emit(ctx: Any, ep: Any, t: int) -> None:
    """One imagined episode from real step ``t``; its steps go out if the filter keeps it."""
    steps = await imagine_from(ctx, ep, t, DEPTH)
    score = None
    if steps and MIN_SCORE > 0:
        score = await ctx.llm.critic(steps[0][0], [(action, answer) for _, action, answer in steps])
        if score is not None:
            ep.stats.imagined_scores.append(score)
    kept = bool(steps) and (MIN_SCORE <= 0 or (score is not None and score >= MIN_SCORE))
    if not kept:
        ep.stats.imagined_dropped += 1
        return
    ep.stats.imagined_kept += 1
    if ctx.cfg.env.draft_turns:
        await ctx.emit(turns_path(ctx, ep, t, steps, score))
        return
    policy_v, wm_v = ctx.llm.last_version(POLICY) or 0, ctx.llm.last_version(WM) or 0
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
