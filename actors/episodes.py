"""An episode's state and figures, and the CoMap loop (draft, imagine, reflect, action gate, act) in
co-evolution and evaluation. The expert's phases (warm-up, reflection-mode initialisation) are in
:mod:`actors.expert_play`, the branches that label and judge steps in :mod:`actors.branches`.

Each runner plays a game on an :class:`~comap_async.envs.pool.AsyncTextEnv` and hands every
message to ``ctx.emit`` (the outbox, or nothing in evaluation), so the loops read top to bottom.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.branches import judge_step
from actors.cycles import cycle_stop_for
from actors.imagined import ImaginedRollouts
from comap_async.diagnostics import loop_steps
from comap_async.envs.base import RestoreDiverged
from comap_async.facts import Facts, NextState, state_delta_f1
from comap_async.method.gates import canonical_action, decision_first, gate_reflection, world_state_score
from comap_async.prompts import Conversation, render_state, turns_of
from comap_async.wire.messages import (
    COEVOLVE,
    POLICY,
    WM,
    ActorMessage,
    Dialogue,
    Registry,
    Transition,
)
from comap_async.wire.messages import Episode as EpisodeMessage

Emit = Callable[[ActorMessage], Awaitable[Any]]
FALLBACK_ACTION = "look"
"""What an unparseable answer executes (counted as a parse problem)."""


@dataclass
class EpisodeContext:
    actor: str
    cfg: Any  # CoMapConfig
    llm: Any  # AgentLLM (unused by expert episodes)
    emit: Emit
    next_state: NextState
    """The environment's fact-state update (``comap_async.envs.get_next_state``)."""
    registry: Callable[[], Registry]
    """The current registry (the actor's :class:`~actors.registry_view.RegistryView`)."""
    on_step: Callable[[], None] | None = None
    """Called after every real environment step (evaluation's progress bar)."""
    cycle_check: bool = False
    """Evaluation with ``eval.cycle_stop`` (``comap eval --cycle-check``): play each episode to its end
    and record whether the projection made at its first recurring state was exact
    (:attr:`EpisodeStats.cycle_check`)."""


@dataclass
class EpisodeStats:
    steps: int = 0
    won: bool = False
    reward: float = 0.0
    revisions: int = 0
    invalid: int = 0
    parse_problems: int = 0
    delta_f1: list[float] = field(default_factory=list)
    reflections: int = 0
    demos: int = 0
    """Warm-up: demonstrations sent (what the broker stores in ``demos``: per step, or per path in the turns form)."""
    labels: dict[str, int] = field(default_factory=dict)
    """Reflection initialisation: samples per label (``expert_better``, ``equal_draft``, ``not_better``)."""
    restore_diverged: int = 0
    """Branches skipped because replaying the episode's prefix did not rebuild its state
    (:class:`~comap_async.envs.base.RestoreDiverged`: ScienceWorld is not always deterministic)."""
    unreadable_real: int = 0
    """Real observations the fact parser could not read (the fact state then stays as it was)."""
    reflection_problems: int = 0
    """Reflections whose own text could not be read as written (no decision word, no ``Final Action:``)."""
    unreadable_reflections: int = 0
    """Reflections that yielded no decision probability or no action even after the continuation."""
    gate_reasons: dict[str, int] = field(default_factory=dict)
    """Per step of the CoMap loop: why the action gate opened or stayed shut (``revised``, ``keep``...)."""
    revisions_played: list[tuple[int, str, str]] = field(default_factory=list)
    """Per played step whose action gate opened: ``(step, a_draft, a_ref)``, what the revision replaced
    (steps a cycle stop projects are counted in ``revisions``, not listed here)."""
    state_actions: list[tuple[Facts, str]] = field(default_factory=list)
    """Per step: the state's canonical facts and the canonical action taken there (the loop rate)."""
    lookahead: list[Any] = field(default_factory=list)
    """Evaluation with ``lookahead``: per step, the candidates, their scores and the one executed
    (:class:`actors.lookahead.LookaheadStep`)."""
    imagined_kept: int = 0
    imagined_dropped: int = 0
    """``actor.imagined_rollouts``: imagined episodes sent / dropped by the filter (:mod:`actors.imagined`)."""
    imagined_scores: list[float] = field(default_factory=list)
    """The critic's scores of the imagined episodes it read (kept or not): what the filter cut at."""
    judged_steps: list[tuple[int, int, int]] = field(default_factory=list)
    """Evaluation with reflection metrics: per step, ``(m, z_draft, z_ref)`` (docs/design.md section 11)."""
    cycle_projected: int = 0
    """Evaluation with ``eval.cycle_stop``: steps not played because the episode had entered a cycle,
    counted in every figure as they would have gone (:mod:`actors.cycles`)."""
    demo_fallback: bool = False
    """``actor.demonstrations: handcoded``: the expert lost this game, so the walkthrough was demonstrated."""
    cycle_check: dict[str, Any] | None = None
    """``comap eval --cycle-check``: how the projection at the first recurrence compared with the episode
    played to its end (:func:`actors.cycles.compare`)."""

    @property
    def loops(self) -> int:
        """Steps that repeated an action already taken from the same state (:func:`loop_steps`)."""
        return loop_steps(self.state_actions)

    def metrics(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {
            "revision_rate": self.revisions / n,
            "invalid_rate": self.invalid / n,
            "parse_problem_rate": self.parse_problems / n,
            "loop_rate": self.loops / n,
        }
        if self.delta_f1:
            out["delta_f1"] = sum(self.delta_f1) / len(self.delta_f1)
        if self.reflections:
            out["reflections"] = float(self.reflections)
        if self.restore_diverged:
            out["restore_diverged"] = float(self.restore_diverged)
        if self.imagined_kept or self.imagined_dropped:
            out["imagined_kept"] = float(self.imagined_kept)
            out["imagined_dropped"] = float(self.imagined_dropped)
        if self.imagined_scores:
            out["imagined_score_mean"] = sum(self.imagined_scores) / len(self.imagined_scores)
            out["imagined_score_max"] = max(self.imagined_scores)
        if self.demo_fallback:
            out["demo_fallback"] = 1.0
        if self.cycle_projected:
            out["cycle_projected_steps"] = float(self.cycle_projected)
        if self.lookahead:  # how often the look-ahead overruled the first sampled candidate
            out["lookahead_switch_rate"] = sum(step.chosen > 0 for step in self.lookahead) / len(self.lookahead)
        if self.gate_reasons:
            out["reflection_problem_rate"] = self.reflection_problems / n
            out["unreadable_reflection_rate"] = self.unreadable_reflections / n
            out["gate_open_rate"] = self.gate_reasons.get("revised", 0) / n
        return out


def registry_versions(registry: Registry) -> tuple[int, int]:
    return registry.versions.get(POLICY, 0), registry.versions.get(WM, 0)


class Episode:
    """The textual state of one running episode (task, history, current observation)."""

    def __init__(self, ctx: EpisodeContext, game: Any, episode_id: str, first: Any) -> None:
        self.ctx, self.game, self.id = ctx, game, episode_id
        self.task = first.info.get("task") or ""
        self.first_observation = first.observation
        self.history: list[tuple[str, str]] = []
        self.current = first
        self.stats = EpisodeStats()
        self.t0 = time.time()
        # C(s_t): the canonical facts of the state, updated by every real observation
        self.facts: Facts = self._observe(frozenset(), first.observation)
        self.facts_before: Facts = self.facts  # the state before the last action (for its transition)
        self.actions: list[str] = []
        self.locations: list[str] = [first.location]  # per step t, StepResult.location

    def _observe(self, facts: Facts, observation: str) -> Facts:
        after = self.ctx.next_state(facts, observation)
        if after is None:
            self.stats.unreadable_real += 1
            return facts
        return after

    def observation_at(self, t: int) -> str:
        """The real observation the episode's step ``t`` was taken from."""
        return self.history[t - 1][1] if t > 0 else self.first_observation

    def location_at(self, t: int) -> str:
        """Where the agent was at step ``t`` (''; or with ``env.show_location``, the environment's
        :attr:`~comap_async.envs.base.StepResult.location` then)."""
        return self.locations[t] if self.ctx.cfg.env.show_location else ""

    def state(self) -> str:
        e = self.ctx.cfg.env
        return render_state(
            self.task,
            self.history,
            self.current.observation,
            self.current.admissible,
            e.history_k,
            e.show_admissible,
            self.location_at(len(self.history)),
        )

    def imagined_state(self, imagined: Sequence[tuple[str, str]]) -> str:
        """``s_t`` continued by ``imagined`` (action, the world model's answer) pairs (the look-ahead):
        no admissible list, and the real step's room (an imagined step's is not known)."""
        if not imagined:
            return self.state()
        e = self.ctx.cfg.env
        history = [*self.history, *imagined]
        location = self.location_at(len(self.history))
        return render_state(self.task, history, imagined[-1][1], None, e.history_k, e.show_admissible, location)

    def draft_state(self, imagined: Sequence[tuple[str, str]] = ()) -> str | Conversation:
        """What the draft sees now: the episode's turns (``env.draft_turns``), else ``s_t``; continued
        by ``imagined`` pairs when given (:meth:`imagined_state`)."""
        if self.ctx.cfg.env.draft_turns:
            return Conversation(self.task, self.first_observation, (*self.history, *imagined))
        return self.imagined_state(imagined)

    def draft_state_before_last(self) -> Conversation:
        """The episode's turns before its last step (the state that step was taken from, as the draft saw it)."""
        return Conversation(self.task, self.first_observation, tuple(self.history[:-1]))

    def instead_of_last(self, action: str, result: Any) -> "Episode":
        """A copy of this episode as if its last step had taken ``action`` (with ``result``, played
        on another environment) instead: its own stats, the same id, task and earlier history."""
        other = copy.copy(self)
        other.history, other.actions, other.stats = self.history[:-1], self.actions[:-1], EpisodeStats()
        other.locations = self.locations[:-1]
        other.facts = self.facts_before
        other.advance(action, result)
        return other

    def advance(self, action: str, nxt: Any) -> None:
        self.stats.state_actions.append((self.facts, canonical_action(action)))
        self.history.append((action, nxt.observation))
        self.actions.append(action)
        self.locations.append(nxt.location)
        self.facts_before, self.facts = self.facts, self._observe(self.facts, nxt.observation)
        self.current = nxt
        if self.ctx.on_step is not None:
            self.ctx.on_step()
        self.stats.steps += 1
        self.stats.won, self.stats.reward = nxt.won, self.stats.reward + nxt.reward

    def transition(
        self,
        phase: str,
        t: int,
        o: str,
        s: str,
        policy_version: int | None = None,
        wm_version: int | None = None,
        **fields: Any,
    ) -> Transition:
        """``policy_version``/``wm_version``: the adapters that generated the step's fields (the draft
        call's, the call that produced ``s_hat_exec``: ``AgentLLM.last_version``); None = the registry's."""
        policy_v, wm_v = registry_versions(self.ctx.registry())
        policy_v = policy_v if policy_version is None else policy_version
        wm_v = wm_v if wm_version is None else wm_version
        nxt = self.current
        step = dict(
            id=f"{self.id}:{t}",
            s_next=nxt.observation,
            reward=float(nxt.reward),
            done=bool(nxt.done),
            won=bool(nxt.won),
            policy_version=policy_v,
            wm_version=wm_v,
        )
        step.update(fields)  # e.g. an explored action's own outcome
        e = self.ctx.cfg.env
        if e.reflect_turns or e.wm_turns:  # the conversation before this step: its last turn is the step's own
            step["dialogue"] = dialogue_of(self.draft_state_before_last())
        return Transition(
            seq=0,
            actor=self.ctx.actor,
            env=self.ctx.cfg.env.name,
            game=self.game.name,
            split=self.game.split,
            episode=self.id,
            t=t,
            o=o,
            phase=phase,
            goal=self.task,
            s=s,
            ts=time.time(),
            facts=sorted(self.facts_before),
            **step,
        )

    async def finish(self, phase: str, eval_mode: bool) -> EpisodeStats:
        policy_v, wm_v = registry_versions(self.ctx.registry())
        await self.ctx.emit(
            EpisodeMessage(
                seq=0,
                id=self.id,
                actor=self.ctx.actor,
                env=self.ctx.cfg.env.name,
                game=self.game.name,
                split=self.game.split,
                phase=phase,
                eval=eval_mode,
                steps=self.stats.steps,
                won=self.stats.won,
                reward=float(self.stats.reward),
                policy_version=policy_v,
                wm_version=wm_v,
                wall_s=time.time() - self.t0,
                ts=time.time(),
                metrics=self.stats.metrics(),
            )
        )
        return self.stats


def dialogue_of(conversation: Conversation) -> Dialogue:
    """A conversation as sent with a transition or a reflection sample (``env.reflect_turns``, ``env.wm_turns``)."""
    return Dialogue(task=conversation.task, first=conversation.first, turns=list(conversation.turns))


async def _teach_and_emit(ctx: EpisodeContext, transition: Transition, seen: Conversation | None) -> None:
    """The teacher's prediction of the observed next state (``s_next``; ``seen``: the draft's conversation
    at the step), the world-state gate's reliability of the two predictions on this actor's fact state,
    then the step's transition."""
    transition.s_hat_teacher = await ctx.llm.teacher(transition.s, transition.a_exec, transition.s_next, seen)
    transition.ws_score = world_state_score(
        ctx.next_state, frozenset(transition.facts), transition.s_hat_exec, transition.s_hat_teacher
    )
    await ctx.emit(transition)


async def draft_outcome(ep: Episode, env: Any, game: Any, a_draft: str) -> str | None:
    """The draft's real next observation at ``ep``'s current state: ``env`` restored by replay to
    it, then the draft taken. None (counted in ``restore_diverged``) where the replay does not
    rebuild that state."""
    try:
        await env.restore(game, list(ep.actions))
    except RestoreDiverged:
        ep.stats.restore_diverged += 1
        return None
    return (await env.step(a_draft)).observation


async def play_coevolve(
    ctx: EpisodeContext,
    env: Any,
    game: Any,
    episode_id: str,
    eval_mode: bool = False,
    branch: Any = None,
    counterfactual: Any = None,
    oracle: Any = None,
) -> EpisodeStats:
    """The CoMap step: draft -> imagine -> reflect -> action gate -> act -> teacher -> transition.

    With a ``branch`` environment (evaluation with reflection metrics), every step is judged by
    :func:`actors.branches.judge_step` before it is taken: ``(m, z_draft, z_ref)`` for URR, HRR and BRP.
    With a ``counterfactual`` environment (training), a step that executes another action than the
    draft also takes the draft there, from the restored state: its real next observation
    (``s_next_draft``) is the future the world-state gate shows when it does not trust the imagined one.
    With an ``oracle`` environment (evaluation, ``comap_oracle``), the reflection is shown the draft's
    true next state taken there instead of the world model's prediction (the world model's own where
    the replay diverges); no Delta-F1 is counted, the world model having predicted nothing.
    """
    llm = ctx.llm
    ep = Episode(ctx, game, episode_id, await env.reset(game))
    plan = await env.walkthrough() if branch is not None else []
    cycles = cycle_stop_for(ctx.cfg, "comap", ctx.cycle_check) if eval_mode else None
    previous: Any = None  # the last step's teacher request and transition, still to be sent
    imagined = ImaginedRollouts(ctx, ep) if not eval_mode and ctx.cfg.actor.imagined_rollouts > 0 else None
    try:
        while not ep.current.done:
            o, s, t, expert = ep.current.observation, ep.state(), ep.stats.steps, ep.current.expert_action
            if cycles is not None and cycles.stop(s, ep.stats):
                break
            if imagined is not None:
                imagined.at(t)
            admissible = ep.current.admissible
            seen = ep.draft_state()
            if previous is not None:  # its teacher call shares the server with this draft
                drafted, _ = await asyncio.gather(llm.draft_scored(seen, admissible=admissible), previous)
                previous = None
            else:
                drafted = await llm.draft_scored(seen, admissible=admissible)
            a_draft, confidence = drafted.action, drafted.confidence
            policy_v = llm.last_version("policy")  # the adapters that generated this step's fields
            if a_draft is None:  # unparseable draft: fall back to a harmless command, as the paper's agents do
                ep.stats.parse_problems += 1
                a_draft = FALLBACK_ACTION
            s_hat = await draft_outcome(ep, oracle, game, a_draft) if oracle is not None else None
            if s_hat is None:
                s_hat = await llm.imagine(s, a_draft, turns_of(seen))
            wm_v = llm.last_version("wm")
            refl = await llm.reflect(
                s,
                a_draft,
                s_hat,
                confidence,
                admissible,
                keep_at_or_below=decision_first(ctx.cfg, evaluating=eval_mode),
                conversation=turns_of(seen),
            )
            ep.stats.parse_problems += refl.problem is not None
            ep.stats.reflection_problems += refl.problem is not None
            ep.stats.unreadable_reflections += not refl.readable
            gate = gate_reflection(ctx.cfg, refl, a_draft)
            ep.stats.gate_reasons[gate.reason] = ep.stats.gate_reasons.get(gate.reason, 0) + 1
            a_exec = refl.a_ref if gate.open else a_draft
            if branch is not None:
                z_draft, z_ref = await judge_step(branch, game, list(ep.actions), a_draft, refl.a_ref, plan)
                ep.stats.judged_steps.append((int(gate.open), z_draft, z_ref))
            ep.stats.revisions += gate.open
            if gate.open:
                ep.stats.revisions_played.append((t, a_draft, refl.a_ref))
            ep.stats.invalid += bool(admissible) and a_exec not in admissible
            s_next_draft = None
            if counterfactual is not None and not eval_mode and a_exec != a_draft:
                s_next_draft = await draft_outcome(ep, counterfactual, game, a_draft)
            ep.advance(a_exec, await env.step(a_exec))
            if a_exec != a_draft:  # revised by the gate
                s_hat_exec, wm_v = await llm.imagine(s, a_exec, turns_of(seen)), llm.last_version("wm")
            else:
                s_hat_exec = s_hat
            score = state_delta_f1(ctx.next_state, ep.facts_before, s_hat_exec, ep.current.observation)
            if score is not None and oracle is None:
                ep.stats.delta_f1.append(score)
            if eval_mode:
                continue
            # the transition is taken now (it reads the episode's current step); the teacher fills s_hat_teacher
            send = _teach_and_emit(
                ctx,
                ep.transition(
                    COEVOLVE,
                    t,
                    o,
                    s,
                    a_draft=a_draft,
                    s_hat=s_hat,
                    decision=refl.decision,
                    a_ref=refl.a_ref,
                    p_revise=refl.p_revise,
                    q_ref=refl.q_ref,
                    a_exec=a_exec,
                    s_hat_exec=s_hat_exec,
                    s_next_draft=s_next_draft,
                    s_hat_teacher="",
                    expert_action=expert,
                    policy_version=policy_v,
                    wm_version=wm_v,
                    reflection_readable=refl.readable,
                    draft_confidence=confidence,
                ),
                turns_of(seen),
            )
            previous = asyncio.ensure_future(send)  # its teacher call goes out beside the next step's draft
    except asyncio.CancelledError:
        if previous is not None:
            previous.cancel()
        if imagined is not None:
            imagined.cancel()
        raise
    except Exception:
        if imagined is not None:
            imagined.cancel()
        if previous is not None:  # the step before the failure is complete: its transition still goes out
            await asyncio.gather(previous, return_exceptions=True)
        raise
    if previous is not None:
        await previous
    if imagined is not None:
        await imagined.finish()
    if cycles is not None:
        cycles.finish(ep.stats)
    return await ep.finish(COEVOLVE, eval_mode)
