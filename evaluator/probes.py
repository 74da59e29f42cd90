"""Held-out probes: cheap, deterministic measures of an adapter version that move early.

Success rate needs whole episodes and moves late. Along each game's expert walkthrough
(teacher-forced states: the expert's actions, whatever the policy would have done) the probes ask
the models greedily:

* **world-model Delta-F1**: the student predicts the next observation of the expert's action, and
  of a fixed, seeded set of non-expert actions (failures: ``Nothing happens.``, a wrong receptacle),
  scored at the state level (:func:`comap_async.facts.state_delta_f1`) against the real one;
* **draft accuracy**: the share of states where the policy's draft is canonically the expert's
  action, and the share where it is admissible at all;
* **reflection**: the policy reflects on its draft with the world model's prediction for it, as in
  the CoMap loop: how often its text cannot be read as written, how often the action gate would
  open and why it stays shut, and whether ``p`` discriminates (``p_discrimination``: mean ``p``
  on wrong drafts minus mean ``p`` on right ones; above 0 when it tends to revise the wrong ones).

Three or four model calls per walkthrough state (draft, the expert action's prediction, the draft's
prediction when it differs, the reflection) and one per failure transition; no teacher.
The walkthrough is teacher-forced, so each game's states are stepped first and their calls then go
to the server together (``PROBE_STATES`` states at a time over all games): an evaluation is
paced by batched decoding, not by one state's chain of calls after another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from comap_async.method.gates import canonical_action
from comap_async.prompts import turns_of
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
    p_revise: float | None = None
    """Walkthrough rows: ``p`` of the reflection on the draft (None: no draft, or unreadable)."""
    reflection_problem: bool | None = None
    """Walkthrough rows: the reflection's text could not be read as written."""
    gate_reason: str | None = None
    """Walkthrough rows: the action gate's reason (``revised`` when it opens, ``unreadable``...)."""
    draft_confidence: float | None = None
    """Walkthrough rows with ``actor.reflect_confidence``: the draft's confidence shown to the reflection."""
    executed_match: bool | None = None
    """Walkthrough rows with a draft: the action the CoMap step executes (the reflected one where the
    gate opens, else the draft) is canonically the expert action."""


PROBE_STATES = 8
"""Walkthrough states whose model calls are in flight at once, over all probed games (the walkthrough is
teacher-forced, so every state is known before the first call); 0: one state at a time per game, in
order, the path before, kept as the batched path's oracle (``tests/integration/test_probes_batched.py``)."""


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
        "wm_delta_f1": _mean(wm),
        "wm_delta_f1_walkthrough": _mean(wm_walk),
        "wm_delta_f1_failures": _mean(wm_fail),
        "draft_accuracy": _mean([float(bool(r.draft_match)) for r in walk]),
        "admissible_rate": _mean([float(bool(r.draft_admissible)) for r in walk]),
        "walkthrough_states": len(walk),
        "failure_transitions": len(rows) - len(walk),
        "wm_scored": len(wm),
        "games": len({r.game for r in rows}),
        **summarize_reflections(walk),
    }


def auc(pos: Sequence[float], neg: Sequence[float]) -> float | None:
    """P(a positive scores above a negative), ties half (None without both)."""
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def summarize_reflections(walk: Sequence[ProbeRow]) -> dict[str, Any]:
    """The reflection figures of the walkthrough rows (those with a draft to reflect on)."""
    reflected = [r for r in walk if r.gate_reason is not None]
    reasons: dict[str, int] = {}
    for r in reflected:
        reasons[r.gate_reason] = reasons.get(r.gate_reason, 0) + 1
    read = [r for r in reflected if r.p_revise is not None]
    right = [r.p_revise for r in read if r.draft_match]
    wrong = [r for r in read if not r.draft_match]
    # a wrong draft the game would refuse ("Nothing happens.") is one the imagined future can show
    # as wrong; an admissible wrong one (another receptacle) looks like progress in imagination too
    refused = [r.p_revise for r in wrong if not r.draft_admissible]
    admitted = [r.p_revise for r in wrong if r.draft_admissible]
    p_of_wrong = [r.p_revise for r in wrong]
    p_wrong, p_right = _mean(p_of_wrong), _mean(right)
    # what the reflection was shown (actor.reflect_confidence): does the draft's own confidence
    # already tell wrong drafts from right ones, whatever p makes of it?
    conf_wrong = [r.draft_confidence for r in reflected if not r.draft_match and r.draft_confidence is not None]
    conf_right = [r.draft_confidence for r in reflected if r.draft_match and r.draft_confidence is not None]
    # what the gate's openings did on these states: a revision that fixes a wrong draft, or breaks a right one
    executed = [r for r in reflected if r.executed_match is not None]
    return {
        "reflections": len(reflected),
        "executed_accuracy": _mean([float(bool(r.executed_match)) for r in executed]),
        "revisions_fixed": sum(1 for r in executed if r.executed_match and not r.draft_match),
        "revisions_broke": sum(1 for r in executed if r.draft_match and not r.executed_match),
        "reflection_problem_rate": _mean([float(bool(r.reflection_problem)) for r in reflected]),
        "unreadable_rate": _mean([float(r.gate_reason == "unreadable") for r in reflected]),
        "gate_open_rate": _mean([float(r.gate_reason == "revised") for r in reflected]),
        "gate_reasons": reasons,
        "p_wrong_draft": p_wrong,
        "p_right_draft": p_right,
        "p_discrimination": None if p_wrong is None or p_right is None else p_wrong - p_right,
        "p_auc": auc(p_of_wrong, right),
        "p_wrong_inadmissible": _mean(refused),
        "p_wrong_admissible": _mean(admitted),
        "p_states": {"right": len(right), "wrong_inadmissible": len(refused), "wrong_admissible": len(admitted)},
        "confidence_wrong_draft": _mean(conf_wrong),
        "confidence_right_draft": _mean(conf_right),
        # a right draft's confidence above a wrong one's: the same chance as a wrong one's doubt above
        "confidence_auc": auc(conf_right, conf_wrong),
    }


def probe_line(probes: dict[str, Any]) -> str:
    """The last line of ``comap eval --probes``."""

    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    return (
        f"wm_delta_f1={f(probes['wm_delta_f1'])} draft_accuracy={f(probes['draft_accuracy'])} "
        f"executed_accuracy={f(probes.get('executed_accuracy'))} "
        f"admissible_rate={f(probes['admissible_rate'])} "
        f"reflection_problem_rate={f(probes.get('reflection_problem_rate'))} "
        f"gate_open_rate={f(probes.get('gate_open_rate'))} p_discrimination={f(probes.get('p_discrimination'))}"
    )


@dataclass(frozen=True, slots=True)
class ProbeState:
    """One walkthrough state, stepped before any model call: the walkthrough is teacher-forced, so
    its states do not depend on what the models answer."""

    t: int
    expert: str
    s: str
    seen: Any
    """What the draft sees (:meth:`actors.episodes.Episode.draft_state`: ``s``, or the episode's turns)."""
    before: Any
    admissible: Sequence[str]
    observation: str
    """The real observation after the expert's action."""
    failure: tuple[str, str] | None
    """A seeded non-expert action taken here on the branch, and its real observation."""


async def walkthrough_states(ctx: Any, env: Any, branch: Any, game: Any, failures: int, seed: int) -> list[ProbeState]:
    """Every walkthrough state of ``game`` and its seeded failure transitions (executed on
    ``branch``, restored to the walkthrough state by replay): environment steps only."""
    from actors.episodes import Episode
    from actors.explore import explore_action

    ep = Episode(ctx, game, f"probe:{game.name}", await env.reset(game))
    plan = await env.walkthrough()
    rng = random.Random(f"probe:{seed}:{game.name}")
    failure_at = set(rng.sample(range(len(plan)), min(failures, len(plan))))
    states: list[ProbeState] = []
    for t, expert in enumerate(plan):
        if ep.current.done:
            break
        s, seen, before, admissible = ep.state(), ep.draft_state(), ep.facts, ep.current.admissible
        failure = None
        if t in failure_at:
            action = explore_action(rng, admissible, expert, invalid_share=0.5)
            if action is not None:
                await branch.restore(game, plan[:t])
                failure = (action, (await branch.step(action)).observation)
        ep.advance(expert, await env.step(expert))
        states.append(ProbeState(t, expert, s, seen, before, admissible, ep.current.observation, failure))
    return states


async def probe_state(ctx: Any, game: Any, st: ProbeState) -> list[ProbeRow]:
    """The model calls of one walkthrough state: the CoMap step on it (draft, imagine, reflect,
    gate) and the prediction of its failure transition."""
    from comap_async.facts import state_delta_f1
    from comap_async.method.gates import gate_reflection

    llm = ctx.llm
    # independent calls go together: the server decodes them in one batch
    conversation = turns_of(st.seen)
    drafted, s_hat = await asyncio.gather(
        llm.draft_scored(st.seen, admissible=st.admissible), llm.imagine(st.s, st.expert, conversation)
    )
    draft = drafted.action
    match, ok = draft_scores(draft, st.expert, st.admissible)
    reflected: dict[str, Any] = {}
    if draft is not None:
        s_hat_draft = s_hat if match else await llm.imagine(st.s, draft, conversation)
        refl = await llm.reflect(st.s, draft, s_hat_draft, drafted.confidence, st.admissible, conversation=conversation)
        gate = gate_reflection(ctx.cfg, refl, draft)
        executed = refl.a_ref if gate.open else draft
        reflected = {
            "p_revise": refl.p_revise if refl.readable else None,
            "reflection_problem": refl.problem is not None,
            "gate_reason": gate.reason,
            "draft_confidence": drafted.confidence,
            "executed_match": canonical_action(executed) == canonical_action(st.expert),
        }
    f1 = state_delta_f1(ctx.next_state, st.before, s_hat, st.observation)
    rows = [ProbeRow(game.name, st.t, "walkthrough", f1, match, ok, **reflected)]
    if st.failure is not None:
        action, real = st.failure
        x_hat = await llm.imagine(st.s, action, conversation)
        rows.append(ProbeRow(game.name, st.t, "failure", state_delta_f1(ctx.next_state, st.before, x_hat, real)))
    return rows


async def probe_game(
    ctx: Any, env: Any, branch: Any, game: Any, failures: int, seed: int, slots: asyncio.Semaphore | None = None
) -> list[ProbeRow]:
    """The probes of one game: every walkthrough state, plus ``failures`` seeded failure transitions.

    The environment walks the whole walkthrough first; then the states' model calls go out
    together, at most ``slots`` states at a time (one state at a time without it: the calls of a
    state still go in order)."""
    states = await walkthrough_states(ctx, env, branch, game, failures, seed)
    return [row for rows in await each_state(states, lambda st: probe_state(ctx, game, st), slots) for row in rows]


async def each_state(
    states: Sequence[ProbeState], probe: Callable[[ProbeState], Awaitable[Any]], slots: asyncio.Semaphore | None
) -> list[Any]:
    """``probe`` of every state, in order: one state after another without ``slots``, else all
    together, at most ``slots`` at a time (the server batches their calls)."""
    if slots is None:
        return [await probe(st) for st in states]

    async def one(st: ProbeState) -> Any:
        async with slots:
            return await probe(st)

    return list(await asyncio.gather(*(one(st) for st in states)))


async def run_probes(
    cfg: Any,
    games: Sequence[Any],
    registry: Registry,
    log: Any,
    on_game: Callable[[], None] | None = None,
    on_step: Callable[[], None] | None = None,
    failures_per_game: int = 2,
    counterfactual: bool = False,
    priority: int = 0,
) -> dict[str, Any]:
    """Probe ``games`` with the adapters ``registry`` names (greedy, ``actor.envs`` games at a time).
    ``counterfactual``: the counterfactual probes instead (:mod:`evaluator.counterfactual`); ``priority``:
    the model calls' (the evaluator's ``eval.priority``)."""
    from actors.episodes import EpisodeContext
    from actors.llm import AgentLLM
    from actors.registry_view import RegistryView
    from comap_async.envs import env_pool_from_config, get_next_state
    from comap_async.models import resolve_model
    from comap_async.prompts import Prompts
    from comap_async.wire.inference_client import InferenceClient, affinity
    from evaluator.counterfactual import counterfactual_game, rows_as_dicts, summarize_counterfactual

    prompts = Prompts.for_model(resolve_model(cfg.model.name_or_path, cfg.model.cache_dir), cfg)
    greedy = cfg.actor.model_copy(update={"temperature": 0.0})
    async with InferenceClient.from_config(cfg, priority=priority) as client:
        models = await client.models()
        llm = AgentLLM(client, prompts, greedy, base_model=models[0] if models else "", registry=RegistryView(registry))

        async def emit(msg: Any) -> None:
            return None

        ctx = EpisodeContext("probe", cfg, llm, emit, get_next_state(cfg.env.name), lambda: registry, on_step)
        queue: asyncio.Queue = asyncio.Queue()
        for g in games:
            queue.put_nowait(g)
        rows: list[Any] = []
        failed: list[str] = []
        slots = asyncio.Semaphore(PROBE_STATES) if PROBE_STATES else None
        pool = env_pool_from_config(cfg, workers=cfg.actor.env_workers)
        await pool.start()
        try:

            async def worker() -> None:
                env, branch = pool.env(), pool.env()
                while not queue.empty():
                    game = queue.get_nowait()
                    affinity.set(f"probe:{game.name}")  # one game's prompts share prefixes: one server's cache
                    try:
                        if counterfactual:
                            rows.extend(await counterfactual_game(ctx, env, branch, game, cfg.run.seed, slots))
                        else:
                            rows.extend(
                                await probe_game(ctx, env, branch, game, failures_per_game, cfg.run.seed, slots)
                            )
                    except Exception as exc:  # noqa: BLE001 - one game's failure is counted, not fatal
                        failed.append(game.name)
                        log.warning("eval.probe_failed", game=game.name, error=repr(exc)[:300])
                    if on_game is not None:
                        on_game()

            await asyncio.gather(*(worker() for _ in range(min(cfg.actor.envs, len(games)))))
        finally:
            await pool.close()
    rows.sort(key=lambda r: (r.game, r.t, getattr(r, "kind", "")))
    log.info("eval.probes_done", games=len(games), rows=len(rows), failed=len(failed))
    if failed and len(failed) == len(games):
        raise RuntimeError(f"every probed game failed (first: {failed[0]}); see the eval.probe_failed log lines")
    if counterfactual:
        return {**summarize_counterfactual(rows), "failed_games": failed, "rows": rows_as_dicts(rows)}
    # the rows too: a figure added later (p_auc was) can be recomputed on an old report
    return {**summarize_probes(rows), "failed_games": failed, "rows": [dataclasses.asdict(r) for r in rows]}
