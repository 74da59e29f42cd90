"""Held-out probes: cheap, deterministic measures of an adapter version that move early (issue 14).

Success rate needs whole episodes and moves late. Along each game's expert walkthrough
(teacher-forced states: the expert's actions, whatever the policy would have done) the probes ask
the models greedily:

* **world-model Delta-F1**: the student predicts the next observation of the expert's action, and
  of a fixed, seeded set of non-expert actions (failures: ``Nothing happens.``, a wrong receptacle),
  scored at the state level (:func:`comap_async.facts.state_delta_f1`) against the real one;
* **draft accuracy**: the share of states where the policy's draft is canonically the expert's
  action, and the share where it is admissible at all.

Two model calls per walkthrough state and one per failure transition; no reflection, no teacher.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from comap_async.gates import canonical_action
from comap_async.wire.messages import Registry


@dataclass(frozen=True, slots=True)
class ProbeRow:
    """One probed transition."""

    game: str
    t: int
    kind: str
    """``walkthrough`` (the expert's action) or ``failure`` (a seeded non-expert action)."""
    wm_delta_f1: float | None
    """State-level Delta-F1 of the student's prediction; None when the real observation is unreadable."""
    draft_match: bool | None = None
    """Walkthrough rows: the greedy draft is canonically the expert action."""
    draft_admissible: bool | None = None
    """Walkthrough rows: the greedy draft is one of the admissible commands."""


def draft_scores(draft: str | None, expert: str, admissible: Sequence[str]) -> tuple[bool, bool]:
    """(canonically the expert's action, admissible) for one draft; an unparseable draft is neither."""
    if draft is None:
        return False, False
    d = canonical_action(draft)
    return d == canonical_action(expert), d in {canonical_action(a) for a in admissible}


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize_probes(rows: Sequence[ProbeRow]) -> dict[str, Any]:
    """The ``probes`` section of ``eval.json``: means and the counts behind them."""
    walk = [r for r in rows if r.kind == "walkthrough"]
    wm = [r.wm_delta_f1 for r in rows if r.wm_delta_f1 is not None]
    wm_walk = [r.wm_delta_f1 for r in walk if r.wm_delta_f1 is not None]
    wm_fail = [r.wm_delta_f1 for r in rows if r.kind == "failure" and r.wm_delta_f1 is not None]
    return {
        "wm_delta_f1": _mean(wm), "wm_delta_f1_walkthrough": _mean(wm_walk), "wm_delta_f1_failures": _mean(wm_fail),
        "draft_accuracy": _mean([float(bool(r.draft_match)) for r in walk]),
        "admissible_rate": _mean([float(bool(r.draft_admissible)) for r in walk]),
        "walkthrough_states": len(walk), "failure_transitions": len(rows) - len(walk),
        "wm_scored": len(wm), "games": len({r.game for r in rows}),
    }


def probe_line(probes: dict[str, Any]) -> str:
    """The last line of ``comap eval --probes``."""
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    return f"wm_delta_f1={f(probes['wm_delta_f1'])} draft_accuracy={f(probes['draft_accuracy'])} " \
           f"admissible_rate={f(probes['admissible_rate'])}"


async def probe_game(ctx: Any, env: Any, branch: Any, game: Any, failures: int, seed: int) -> list[ProbeRow]:
    """The probes of one game: every walkthrough state, plus ``failures`` seeded failure transitions
    (executed on ``branch``, restored to the walkthrough state by replay)."""
    from actors.episodes import Episode
    from actors.explore import explore_action
    from comap_async.facts import state_delta_f1

    llm = ctx.llm
    ep = Episode(ctx, game, f"probe:{game.name}", await env.reset(game))
    plan = await env.walkthrough()
    rng = random.Random(f"probe:{seed}:{game.name}")
    failure_at = set(rng.sample(range(len(plan)), min(failures, len(plan))))
    rows: list[ProbeRow] = []
    for t, expert in enumerate(plan):
        if ep.current.done:
            break
        s, before, admissible = ep.state(), ep.facts, ep.current.admissible
        draft, _ = await llm.draft(s)
        match, ok = draft_scores(draft, expert, admissible)
        s_hat = await llm.imagine(s, expert)
        ep.advance(expert, await env.step(expert))
        rows.append(ProbeRow(game.name, t, "walkthrough", state_delta_f1(ctx.next_state, before, s_hat,
                                                                         ep.current.observation), match, ok))
        if t in failure_at:
            action = explore_action(rng, admissible, expert, invalid_share=0.5)
            if action is not None:
                await branch.restore(game, plan[:t])
                real = await branch.step(action)
                x_hat = await llm.imagine(s, action)
                rows.append(ProbeRow(game.name, t, "failure", state_delta_f1(ctx.next_state, before, x_hat,
                                                                            real.observation)))
    return rows


async def run_probes(cfg: Any, games: Sequence[Any], registry: Registry, log: Any,
                     on_game: Callable[[], None] | None = None, on_step: Callable[[], None] | None = None,
                     failures_per_game: int = 2) -> dict[str, Any]:
    """Probe ``games`` with the adapters ``registry`` names (greedy, ``actor.envs`` games at a time)."""
    from actors.episodes import EpisodeContext
    from actors.llm import AgentLLM
    from actors.registry_view import RegistryView
    from comap_async.envs import env_pool_from_config, get_next_state
    from comap_async.wire.inference_client import InferenceClient
    from comap_async.models import resolve_model
    from comap_async.prompts import ChatTemplate, Prompts

    prompts = Prompts.from_config(ChatTemplate.from_model_dir(resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)),
                                  cfg)
    greedy = cfg.actor.model_copy(update={"temperature": 0.0, "wm_temperature": 0.0})
    async with InferenceClient.from_config(cfg) as client:
        models = await client.models()
        llm = AgentLLM(client, prompts, greedy, base_model=models[0] if models else "", registry=RegistryView(registry))

        async def emit(msg: Any) -> None:
            return None

        ctx = EpisodeContext("probe", cfg, llm, emit, get_next_state(cfg.env.name), lambda: registry, on_step)
        queue: asyncio.Queue = asyncio.Queue()
        for g in games:
            queue.put_nowait(g)
        rows: list[ProbeRow] = []
        failed: list[str] = []
        pool = env_pool_from_config(cfg, workers=cfg.actor.env_workers)
        await pool.start()
        try:
            async def worker() -> None:
                env, branch = pool.env(), pool.env()
                while not queue.empty():
                    game = queue.get_nowait()
                    try:
                        rows.extend(await probe_game(ctx, env, branch, game, failures_per_game, cfg.run.seed))
                    except Exception as exc:  # noqa: BLE001 - one game's failure is counted, not fatal
                        failed.append(game.name)
                        log.warning("eval.probe_failed", game=game.name, error=repr(exc)[:300])
                    if on_game is not None:
                        on_game()

            await asyncio.gather(*(worker() for _ in range(min(cfg.actor.envs, len(games)))))
        finally:
            await pool.close()
    rows.sort(key=lambda r: (r.game, r.t, r.kind))
    log.info("eval.probes_done", games=len(games), rows=len(rows), failed=len(failed))
    if failed and len(failed) == len(games):
        raise RuntimeError(f"every probed game failed (first: {failed[0]}); see the eval.probe_failed log lines")
    return {**summarize_probes(rows), "failed_games": failed}
