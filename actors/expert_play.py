"""The expert's phases: warm-up (the demonstration replayed, with exploratory and recovery steps on a
branch environment) and reflection-mode initialisation (suffix-labelled reflection samples on the
expert's states). The CoMap loop itself is :func:`actors.episodes.play_coevolve`."""

from __future__ import annotations

import random
import time
from typing import Any

from actors.branches import expert_plan_action, play_branch
from actors.episodes import Episode, EpisodeContext, EpisodeStats, dialogue_of, registry_versions
from actors.explore import explore_action
from comap_async.envs.base import RestoreDiverged, StepResult
from comap_async.method.gates import canonical_action
from comap_async.method.labels import reflection_label
from comap_async.prompts import Conversation
from comap_async.wire.messages import KEEP, REFLECT_INIT, WARMUP, Reflection, Transition, TurnDemos

EXPLORE_INVALID = 0.5
"""Of warm-up's exploratory actions (``actor.warmup_explore``), the share that are inadmissible commands
built from the entities in the admissible list (a take from the wrong receptacle, ``open`` an object,
``go to`` an object: the game answers ``Nothing happens.``); the rest are sampled admissible non-expert
commands (:func:`actors.explore.explore_action`)."""


async def play_expert(ctx: EpisodeContext, env: Any, game: Any, episode_id: str, branch: Any = None) -> EpisodeStats:
    """Warm-up: replay the game's demonstration (:func:`demonstration_start`: the walkthrough, or the
    handcoded expert's own winning play); every step is a demonstration and a real transition,
    labelled with the expert's own action.

    With a ``branch`` environment, a share ``actor.warmup_explore`` of the steps (seeded by the run
    seed and the episode id) also executes a non-expert action (:func:`actors.explore.explore_action`)
    on ``branch``, restored by replay to the expert path, and records that real transition for the
    world model only: ``explore: True``, id ``{episode}:{t}:x``, the same ``s``/``o`` as step t (the
    broker stores no demonstration for it). The expert path continues unchanged on ``env``."""
    a = ctx.cfg.actor
    rng = random.Random(f"{ctx.cfg.run.seed}-{episode_id}")
    first, plan, fallback = await demonstration_start(ctx, env, game)
    ep = Episode(ctx, game, episode_id, first)
    ep.stats.demo_fallback = fallback
    turns = ctx.cfg.env.draft_turns  # the demonstrations go as whole paths (turn_demos), not per step
    while not ep.current.done:
        t = ep.stats.steps
        action = expert_plan_action(ep, plan)
        if action is None:  # no plan left and the handcoded expert gave up: counted as unsolved
            ep.stats.parse_problems += 1
            break
        o, s, label = ep.current.observation, ep.state(), ep.current.expert_action
        explored = None
        if branch is not None and a.warmup_explore > 0 and rng.random() < a.warmup_explore:
            x_action = explore_action(rng, ep.current.admissible, action, EXPLORE_INVALID)
            if x_action is not None:
                try:
                    await branch.restore(game, [taken for taken, _ in ep.history])
                    explored = x_action, await branch.step(x_action)
                except RestoreDiverged:  # no faithful state to explore from: this step explores nothing
                    ep.stats.restore_diverged += 1
        ep.advance(action, await env.step(action))
        await ctx.emit(warmup_transition(ep, t, o, s, action, label, step_demo=not turns))
        ep.stats.demos += int(not turns)
        if explored is not None:  # emitted like step t's own transition, so it gets the same fields (facts)
            x_action, x = explored
            await ctx.emit(
                warmup_transition(
                    ep,
                    t,
                    o,
                    s,
                    x_action,
                    label,
                    id=f"{ep.id}:{t}:x",
                    explore=True,
                    s_next=x.observation,
                    reward=float(x.reward),
                    done=bool(x.done),
                    won=bool(x.won),
                )
            )
            if a.warmup_recovery and not x.done and x.expert_action:
                await emit_recovery(ctx, ep, branch, t, x_action, x)
    if turns and ep.history:
        await ctx.emit(turn_demos(ep, ep.id, [True] * len(ep.history)))
        ep.stats.demos += 1
    return await ep.finish(WARMUP, False)


async def demonstration_start(ctx: EpisodeContext, env: Any, game: Any) -> tuple[StepResult, list[str], bool]:
    """``game`` reset on ``env``, the command sequence its demonstration follows
    (``actor.demonstrations``), and whether that is the walkthrough in place of the handcoded
    expert's play. ``handcoded``: the expert plays from the reset first, on ``env``, which is then
    reset again (the expert's choices are seeded by the reset, so its path replays as it went);
    when it does not win, the walkthrough (nothing is demonstrated that did not reach the goal)."""
    handcoded = ctx.cfg.actor.demonstrations == "handcoded"
    if handcoded:
        result, path = await env.reset(game), []
        while not result.done and result.expert_action is not None:
            path.append(result.expert_action)
            result = await env.step(result.expert_action)
        if result.won:
            return await env.reset(game), path, False
    first = await env.reset(game)
    return first, await env.walkthrough(), handcoded


async def emit_recovery(ctx: EpisodeContext, ep: Episode, branch: Any, t: int, x_action: str, x: Any) -> None:
    """A recovery demonstration: on ``branch``, left in the off-path state by the exploratory action
    ``x_action`` (its result ``x``), the handcoded expert acts; that real step is sent as a warm-up
    transition with ``recovery`` set (the broker stores it as a demonstration too). The state the
    policy sees is :meth:`Episode.instead_of_last`'s; ``ep`` itself is unchanged."""
    off = ep.instead_of_last(x_action, x)
    o, s, expert = off.current.observation, off.state(), x.expert_action
    off.advance(expert, await branch.step(expert))
    turns = ctx.cfg.env.draft_turns
    await ctx.emit(
        warmup_transition(off, t, o, s, expert, expert, id=f"{ep.id}:{t}:r", recovery=True, step_demo=not turns)
    )
    if turns:  # the exploratory action is context; the expert's actions before it and after it are learned
        await ctx.emit(turn_demos(off, f"{ep.id}:{t}:r", [True] * t + [False, True], recovery=True))
    ep.stats.demos += 1  # one stored demonstration either way: the transition itself, or its turn_demos path


def turn_demos(ep: Episode, demo_id: str, targets: list[bool], recovery: bool = False) -> TurnDemos:
    """``ep``'s path as chat turns (``env.draft_turns``), ``targets`` marking the demonstrated actions."""
    policy_v, wm_v = registry_versions(ep.ctx.registry())
    return TurnDemos(
        seq=0,
        id=demo_id,
        actor=ep.ctx.actor,
        game=ep.game.name,
        episode=ep.id,
        goal=ep.task,
        first=ep.first_observation,
        turns=list(ep.history),
        targets=targets,
        recovery=recovery,
        policy_version=policy_v,
        wm_version=wm_v,
        ts=time.time(),
    )


def warmup_transition(ep: Episode, t: int, o: str, s: str, action: str, label: str | None, **extra: Any) -> Transition:
    """A warm-up step's transition: ``action`` executed as its own draft and refinement (no model
    ran: no predictions, KEEP with certainty); ``extra`` sets the id, the flags and, for a step
    taken on another environment, its result."""
    return ep.transition(
        WARMUP,
        t,
        o,
        s,
        a_draft=action,
        s_hat="",
        decision=KEEP,
        a_ref=action,
        p_revise=0.0,
        q_ref=1.0,
        a_exec=action,
        s_hat_exec="",
        s_hat_teacher="",
        expert_action=label,
        **extra,
    )


async def play_reflect_init(ctx: EpisodeContext, env: Any, branch: Any, game: Any, episode_id: str) -> EpisodeStats:
    """Reflection-mode initialisation on demonstration states (suffix-labelled reflection samples).

    At each state of the expert's path the policy drafts. A draft canonically equal to the expert
    action is a keep sample (``y = 0``, label ``equal_draft``). Otherwise a draft branch and an
    expert branch are rolled out from the restored state under the same continuation policy until
    the episode ends (:func:`play_branch`); ``y = 1`` with the expert action as target only when
    the expert branch is strictly better (``expert_better``), else ``y = 0`` with the draft kept
    (``not_better``). ``s̄`` is the real observation right after the draft.

    With ``actor.reflect_init_pairs`` every ``y = 1`` sample comes with its pair: the same state,
    the expert's action as the draft, ``y = 0`` (an equal draft), ``s̄`` the real observation after it.
    """
    first, plan, fallback = await demonstration_start(ctx, env, game)
    ep = Episode(ctx, game, episode_id, first)
    ep.stats.demo_fallback = fallback
    while not ep.current.done and (expert := expert_plan_action(ep, plan)) is not None:
        s, seen, t, prefix = ep.state(), ep.draft_state(), ep.stats.steps, list(ep.actions)
        drafted = await ctx.llm.draft_scored(seen, admissible=ep.current.admissible)
        draft, problem = drafted.action, drafted.problem
        ep.stats.parse_problems += problem == "empty"
        equal = draft is not None and canonical_action(draft) == canonical_action(expert)
        s_bar = None
        if draft is not None and not equal:
            try:
                d_result, s_bar = await play_branch(branch, game, prefix, draft, plan)
                e_result, _ = await play_branch(branch, game, prefix, expert, plan)
                y, label = reflection_label(
                    False, e_result, d_result, sooner=ctx.cfg.method.reflect_init_label == "sooner"
                )
            except RestoreDiverged:  # the branches would not start from this state: no sample here
                ep.stats.restore_diverged += 1
                draft = None
        ep.advance(expert, await env.step(expert))
        if draft is None:
            continue
        if equal:
            y, label, s_bar = *reflection_label(True, None, None), ep.current.observation
        policy_v, wm_v = registry_versions(ctx.registry())
        dialogue = dialogue_of(seen) if ctx.cfg.env.reflect_turns and isinstance(seen, Conversation) else None

        async def emit_sample(
            sample_id: str, a_draft: str, s_bar: str, y: int, label: str, confidence: float | None
        ) -> None:
            await ctx.emit(
                Reflection(
                    seq=0,
                    id=sample_id,
                    actor=ctx.actor,
                    game=game.name,
                    s=s,
                    a_draft=a_draft,
                    s_bar=s_bar,
                    target=expert if y else a_draft,
                    y=y,
                    label=label,
                    draft_confidence=confidence,
                    dialogue=dialogue,
                    policy_version=policy_v,
                    wm_version=wm_v,
                    ts=time.time(),
                )
            )
            ep.stats.reflections += 1
            ep.stats.labels[label] = ep.stats.labels.get(label, 0) + 1

        await emit_sample(f"{episode_id}:{t}:r", draft, s_bar, y, label, drafted.confidence)
        if y == 1 and ctx.cfg.actor.reflect_init_pairs:
            # the same state with the expert's action as the draft: by the definition an equal draft
            # is a keep sample, so the pair differs only in the draft and its outcome, and p must
            # read them to tell the two apart (the state alone says nothing)
            await emit_sample(
                f"{episode_id}:{t}:rp", expert, ep.current.observation, *reflection_label(True, None, None), None
            )
    return await ep.finish(REFLECT_INIT, False)
