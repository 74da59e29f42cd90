"""One episode per phase: expert warm-up, reflection-mode initialisation, the CoMap loop, evaluation.

Each runner plays a game on an :class:`~comap_async.envs.pool.AsyncTextEnv` and hands every
message to ``ctx.emit`` (the outbox, or nothing in evaluation), so the loops read top to bottom.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from comap_async.facts import delta_f1
from comap_async.gates import action_gate, canonical_action
from comap_async.prompts import render_state

Emit = Callable[[dict[str, Any]], Awaitable[Any]]


@dataclass
class EpisodeContext:
    actor: str
    cfg: Any  # CoMapConfig
    llm: Any  # AgentLLM (unused by expert episodes)
    emit: Emit
    parse_facts: Callable[[str], frozenset[str] | None]
    registry: Callable[[], dict[str, Any]]


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
    revision_outcomes: list[tuple[bool, str]] = field(default_factory=list)
    """Evaluation with reflection metrics: per proposed revision, (executed, suffix outcome)."""

    def metrics(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {"revision_rate": self.revisions / n, "invalid_rate": self.invalid / n, "parse_problem_rate": self.parse_problems / n}
        if self.delta_f1:
            out["delta_f1"] = sum(self.delta_f1) / len(self.delta_f1)
        if self.reflections:
            out["reflections"] = float(self.reflections)
        return out


def _versions(registry: dict[str, Any]) -> tuple[int, int]:
    v = registry.get("versions") or {}
    return int(v.get("policy", 0)), int(v.get("wm", 0))


class Episode:
    """The textual state of one running episode (task, history, current observation)."""

    def __init__(self, ctx: EpisodeContext, game: Any, episode_id: str, first: Any) -> None:
        self.ctx, self.game, self.id = ctx, game, episode_id
        self.task = first.info.get("task") or ""
        self.history: list[tuple[str, str]] = []
        self.current = first
        self.stats = EpisodeStats()
        self.t0 = time.time()

    def state(self) -> str:
        e = self.ctx.cfg.env
        return render_state(self.task, self.history, self.current.observation, self.current.admissible,
                            e.history_k, e.show_admissible)

    def advance(self, action: str, nxt: Any) -> None:
        self.history.append((action, nxt.observation))
        self.current = nxt
        self.stats.steps += 1
        self.stats.won, self.stats.reward = nxt.won, self.stats.reward + nxt.reward

    def transition(self, phase: str, t: int, o: str, s: str, **fields: Any) -> dict[str, Any]:
        policy_v, wm_v = _versions(self.ctx.registry())
        nxt = self.current
        return {"type": "transition", "id": f"{self.id}:{t}", "actor": self.ctx.actor, "env": self.ctx.cfg.env.name,
                "game": self.game.name, "split": self.game.split, "episode": self.id, "t": t, "o": o, "phase": phase,
                "goal": self.task, "s": s, "s_next": nxt.observation, "reward": float(nxt.reward), "done": bool(nxt.done),
                "won": bool(nxt.won), "policy_version": policy_v, "wm_version": wm_v, "ts": time.time(), **fields}

    async def finish(self, phase: str, eval_mode: bool) -> EpisodeStats:
        policy_v, wm_v = _versions(self.ctx.registry())
        await self.ctx.emit({
            "type": "episode", "id": self.id, "actor": self.ctx.actor, "env": self.ctx.cfg.env.name,
            "game": self.game.name, "split": self.game.split, "phase": phase, "eval": eval_mode,
            "steps": self.stats.steps, "won": self.stats.won, "reward": self.stats.reward,
            "policy_version": policy_v, "wm_version": wm_v, "wall_s": time.time() - self.t0, "ts": time.time(),
            "metrics": self.stats.metrics(),
        })
        return self.stats


async def play_expert(ctx: EpisodeContext, env: Any, game: Any, episode_id: str) -> EpisodeStats:
    """Warm-up: replay the game's winning walkthrough (the handcoded expert where there is none);
    every step is a demonstration and a real transition, labelled with the expert's own action."""
    ep = Episode(ctx, game, episode_id, await env.reset(game))
    plan = await env.walkthrough()
    while not ep.current.done:
        t = ep.stats.steps
        action = plan[t] if t < len(plan) else ep.current.expert_action
        if action is None:  # no plan left and the handcoded expert gave up: counted as unsolved
            ep.stats.parse_problems += 1
            break
        o, s, label = ep.current.observation, ep.state(), ep.current.expert_action
        ep.advance(action, await env.step(action))
        await ctx.emit(ep.transition(
            "warmup", t, o, s, a_draft=action, s_hat="", decision="KEEP", a_ref=action, p_revise=0.0, q_ref=1.0,
            a_exec=action, s_hat_exec="", s_hat_teacher="", expert_action=label))
    return await ep.finish("warmup", False)


def suffix_outcome(revised: tuple[bool, float], kept: tuple[bool, float]) -> str:
    """Compare two suffix rollouts by (won, return): ``better`` when the one starting with the
    revised action wins where the other does not, or returns more; ``worse`` the other way round."""
    if revised > kept:
        return "better"
    return "worse" if revised < kept else "same"


async def _branch_return(env: Any, game: Any, prefix: list[str], first: str, horizon: int) -> tuple[bool, float, str]:
    """Restore the state after ``prefix``, take ``first``, continue with the expert for the rest of
    the horizon: (won, return, observation right after ``first``)."""
    await env.restore(game, prefix)
    r = await env.step(first)
    after, total = r.observation, r.reward
    for _ in range(horizon - 1):
        if r.done or r.expert_action is None:
            break
        r = await env.step(r.expert_action)
        total += r.reward
    return r.won, total, after


async def judge_revision(ctx: EpisodeContext, branch: Any, game: Any, prefix: list[str], a_draft: str,
                         a_ref: str) -> tuple[str, str]:
    """Suffix rollouts from the state after ``prefix`` (restored on ``branch``): one starting with
    the refined action, one with the draft, both continued by the expert for
    ``actor.suffix_horizon`` steps. Returns the :func:`suffix_outcome` of the refinement and the
    real observation right after the draft. Reflection initialisation labels its samples with it
    (the expert action as the refinement); evaluation judges the policy's own revisions."""
    horizon = ctx.cfg.actor.suffix_horizon
    d_won, d_ret, d_after = await _branch_return(branch, game, prefix, a_draft, horizon)
    r_won, r_ret, _ = await _branch_return(branch, game, prefix, a_ref, horizon)
    return suffix_outcome((r_won, r_ret), (d_won, d_ret)), d_after


async def play_reflect_init(ctx: EpisodeContext, env: Any, branch: Any, game: Any, episode_id: str) -> EpisodeStats:
    """Reflection-mode initialisation on demonstration states (suffix-labelled reflection samples).

    Where the policy's draft differs canonically from the expert action, a draft branch and an
    expert branch are rolled out from the restored state under the same continuation policy (the
    expert) for up to H steps: y=1 with the expert action as target when the expert branch wins or
    returns more, else y=0 with the draft kept. The real observation after the draft is ``s̄``.
    """
    ep = Episode(ctx, game, episode_id, await env.reset(game))
    prefix: list[str] = []
    while not ep.current.done and ep.current.expert_action is not None:
        expert = ep.current.expert_action
        s = ep.state()
        draft, problem = await ctx.llm.draft(s)
        ep.stats.parse_problems += problem == "empty"
        if draft is not None and canonical_action(draft) != canonical_action(expert):
            outcome, d_after = await judge_revision(ctx, branch, game, prefix, draft, expert)
            better = outcome == "better"
            policy_v, wm_v = _versions(ctx.registry())
            await ctx.emit({"type": "reflection", "id": f"{episode_id}:{ep.stats.steps}:r", "actor": ctx.actor,
                            "game": game.name, "s": s, "a_draft": draft, "s_bar": d_after,
                            "target": expert if better else draft, "y": int(better),
                            "policy_version": policy_v, "wm_version": wm_v, "ts": time.time()})
            ep.stats.reflections += 1
        prefix.append(expert)
        ep.advance(expert, await env.step(expert))
    return await ep.finish("reflect_init", False)


async def play_coevolve(ctx: EpisodeContext, env: Any, game: Any, episode_id: str, eval_mode: bool = False,
                        branch: Any = None) -> EpisodeStats:
    """The CoMap step: draft -> imagine -> reflect -> action gate -> act -> teacher -> transition.

    With a ``branch`` environment (evaluation with reflection metrics), every revision the
    reflection proposes (a refined action canonically different from the draft) is judged by
    :func:`judge_revision` before the step is taken, whether the action gate executes it or not.
    """
    g, llm = ctx.cfg.gates, ctx.llm
    ep = Episode(ctx, game, episode_id, await env.reset(game))
    while not ep.current.done:
        o, s, t, expert = ep.current.observation, ep.state(), ep.stats.steps, ep.current.expert_action
        admissible = ep.current.admissible
        a_draft, problem = await llm.draft(s)
        if a_draft is None:  # unparseable draft: fall back to a harmless command, as the paper's agents do
            ep.stats.parse_problems += 1
            a_draft = "look"
        s_hat = await llm.imagine(s, a_draft)
        refl = await llm.reflect(s, a_draft, s_hat)
        ep.stats.parse_problems += refl.problem is not None
        gate = action_gate(refl.p_revise, refl.q_ref, refl.a_ref, a_draft, g.tau_p, g.tau_q)
        a_exec = refl.a_ref if gate.open else a_draft
        if branch is not None and refl.a_ref.strip() and canonical_action(refl.a_ref) != canonical_action(a_draft):
            prefix = [a for a, _ in ep.history]
            outcome, _ = await judge_revision(ctx, branch, game, prefix, a_draft, refl.a_ref)
            ep.stats.revision_outcomes.append((gate.open, outcome))
        ep.stats.revisions += gate.open
        ep.stats.invalid += bool(admissible) and a_exec not in admissible
        ep.advance(a_exec, await env.step(a_exec))
        s_hat_exec = await llm.imagine(s, a_exec) if gate.open else s_hat
        s_hat_teacher = "" if eval_mode else await llm.teacher(s, a_exec, ep.current.observation)
        prev, real = ctx.parse_facts(o), ctx.parse_facts(ep.current.observation)
        if prev is not None and real is not None:
            ep.stats.delta_f1.append(delta_f1(prev, ctx.parse_facts(s_hat_exec), real))
        if not eval_mode:
            await ctx.emit(ep.transition(
                "coevolve", t, o, s, a_draft=a_draft, s_hat=s_hat, decision=refl.decision, a_ref=refl.a_ref,
                p_revise=refl.p_revise, q_ref=refl.q_ref, a_exec=a_exec, s_hat_exec=s_hat_exec,
                s_hat_teacher=s_hat_teacher, expert_action=expert))
    return await ep.finish("coevolve", eval_mode)
