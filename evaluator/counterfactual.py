"""Counterfactual probes: does the reflection read the world model's imagined state?

Two kinds of states are probed in each game: the expert walkthrough's (teacher-forced, as
:mod:`evaluator.probes`), and the policy's own played states (the game played from reset by the
policy's greedy drafts alone, as ``draft_only`` plays, for as many steps as the walkthrough has, or
until it ends): a reflection may read a future differently on the states its own drafts lead to.
At each state the policy's greedy draft (on a played state, the one the game then took) is
reflected on four times, each time shown another future:

* ``imagined``: the world model's prediction for the draft (what the CoMap loop shows);
* ``real``: the draft's true next observation (on a walkthrough state taken on a second environment
  restored to the state; on a played state the game's own answer): an oracle world model;
* ``contradicting``: a future that contradicts the real one: the game's answer to a failed
  command (``Nothing happens.`` in ALFWorld) where the draft works, and where the draft itself
  fails, the real answer to the expert's action (another action's success);
* ``none``: no imagined state at all.

On a played state the expert's action is :func:`actors.branches.expert_plan_action` (the walkthrough
while the play follows it, then the handcoded expert; a state without one is skipped), and a draft is
right when it is canonically that action.

A reflection that reads the world model moves ``p`` between them: up under ``contradicting`` for a
draft that works, and it ranks wrong drafts above right ones better under ``real`` than under
``none``. One that ignores the future gives the same ``p`` under all four. The summary gives, per
future, ``p`` on wrong and right drafts, its AUC for wrong drafts, how often the action gate opens
and how often the executed action is the expert's; and against ``imagined``, the mean ``|delta p|``
and the gate decisions that flip, split by whether the draft was right: for the walkthrough states
at its top level, and the same for the played states under ``played``.

Four reflections, a draft and up to two world-model calls per state, plus one restored branch step
where a walkthrough state's draft is not the expert's action, or a played state's draft fails
(``comap eval --probes --counterfactual``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from comap_async.method.gates import canonical_action
from comap_async.prompts import turns_of
from evaluator.probes import ProbeState, _mean, auc, draft_scores, each_state, walkthrough_states

FUTURES = ("imagined", "real", "contradicting", "none")
"""What the reflection is shown in place of the imagined state, the CoMap loop's first."""

KINDS = ("walkthrough", "played")
"""The states probed: the expert walkthrough's, and those the policy's own greedy drafts lead to."""


@dataclass(frozen=True, slots=True)
class CounterfactualRow:
    """One probed state reflected on under each future."""

    game: str
    t: int
    draft: str
    expert: str
    draft_match: bool
    """The draft is canonically the expert's action (a right draft)."""
    draft_admissible: bool
    draft_fails: bool
    """The game answers the draft as it answers a failed command: nothing changes."""
    p: dict[str, float | None]
    """Per future, ``p`` of the reflection (None: unreadable)."""
    revised: dict[str, bool]
    """Per future, whether the action gate would execute the reflected action."""
    executed_match: dict[str, bool]
    """Per future, whether the action the CoMap step executes is canonically the expert's."""
    kind: str = "walkthrough"
    """``walkthrough`` (a teacher-forced state) or ``played`` (a state the policy's drafts led to)."""


@dataclass(frozen=True, slots=True)
class PlayedState:
    """One state of the policy's own play, with the draft the game then took and its answer."""

    t: int
    expert: str
    """:func:`actors.branches.expert_plan_action` here."""
    s: str
    seen: Any
    admissible: Sequence[str]
    drafted: Any
    """The greedy draft made here (:class:`actors.llm.Draft`), the action played."""
    real: str
    """The game's answer to the draft."""
    prefix: list[str]
    """The actions played before this state (to restore a branch to it)."""


def _same(a: str, b: str) -> bool:
    return " ".join(a.split()).lower() == " ".join(b.split()).lower()


async def failure_answer(branch: Any, game: Any, st: ProbeState) -> str | None:
    """The game's answer to a command it cannot carry out at ``st`` (an inadmissible command built
    from the state's own entities), None where no such command can be built."""
    from actors.explore import inadmissible_candidates

    candidates = inadmissible_candidates(st.admissible)
    if not candidates:
        return None
    await branch.restore(game, [])
    return (await branch.step(candidates[0])).observation


async def reflect_under_futures(
    ctx: Any,
    game: Any,
    kind: str,
    st: ProbeState | PlayedState,
    drafted: Any,
    real: str,
    expert_answer: Callable[[], Awaitable[str]],
    failed: str | None,
) -> CounterfactualRow:
    """The four reflections on ``drafted`` (a readable draft) at ``st``, a state of ``kind``, whose
    real answer is ``real``; ``expert_answer`` gives the real answer to the expert's action, asked
    only where it is the contradicting future (the draft fails and is not the expert's)."""
    from comap_async.method.gates import gate_reflection

    llm = ctx.llm
    conversation = turns_of(st.seen)
    draft = drafted.action
    match, admissible = draft_scores(draft, st.expert, st.admissible)
    fails = failed is not None and _same(real, failed)
    # a draft that works is contradicted by the failure answer; a failing one by the expert action's
    # real answer (another action's success); neither known: the row has no contradicting future
    contradicting = failed if not fails else (None if match else await expert_answer())
    futures: dict[str, str | None] = {
        "imagined": await llm.imagine(st.s, draft, conversation),
        "real": real,
        "contradicting": contradicting,
        "none": None,
    }
    shown = {k: v for k, v in futures.items() if v is not None or k == "none"}
    reflections = await asyncio.gather(
        *(
            llm.reflect(st.s, draft, v, drafted.confidence, st.admissible, conversation=conversation)
            for v in shown.values()
        )
    )
    p: dict[str, float | None] = {}
    revised: dict[str, bool] = {}
    executed: dict[str, bool] = {}
    for key, refl in zip(shown, reflections):
        gate = gate_reflection(ctx.cfg, refl, draft)
        p[key] = refl.p_revise if refl.readable else None
        revised[key] = gate.open
        executed[key] = canonical_action(refl.a_ref if gate.open else draft) == canonical_action(st.expert)
    return CounterfactualRow(game.name, st.t, draft, st.expert, match, admissible, fails, p, revised, executed, kind)


async def reflect_walkthrough(
    ctx: Any,
    game: Any,
    st: ProbeState,
    plan: Sequence[str],
    branch: Any,
    branch_lock: asyncio.Lock,
    failed: str | None,
) -> CounterfactualRow | None:
    """The draft at walkthrough state ``st`` and its four reflections (None: no readable draft)."""
    drafted = await ctx.llm.draft_scored(st.seen, admissible=st.admissible)
    draft = drafted.action
    if draft is None:
        return None
    if draft_scores(draft, st.expert, st.admissible)[0]:
        real = st.observation
    else:
        async with branch_lock:  # restore and step as one: the game's other states share the branch
            await branch.restore(game, list(plan[: st.t]))
            real = (await branch.step(draft)).observation

    async def expert_answer() -> str:
        return st.observation  # the walkthrough stepped the expert's action

    return await reflect_under_futures(ctx, game, "walkthrough", st, drafted, real, expert_answer, failed)


async def played_states(ctx: Any, env: Any, game: Any) -> list[PlayedState]:
    """The policy's own play of ``game`` from reset: its greedy draft executed at each state (the
    fallback action where it has none, as ``draft_only`` plays), for as many steps as the game's
    walkthrough has or until the game ends; the states without a readable draft or an expert
    action are played through but not kept."""
    from actors.branches import expert_plan_action
    from actors.episodes import FALLBACK_ACTION, Episode

    ep = Episode(ctx, game, f"probe:played:{game.name}", await env.reset(game))
    plan = await env.walkthrough()
    states: list[PlayedState] = []
    for t in range(len(plan)):
        if ep.current.done:
            break
        s, seen, admissible = ep.state(), ep.draft_state(), ep.current.admissible
        expert, prefix = expert_plan_action(ep, plan), list(ep.actions)
        drafted = await ctx.llm.draft_scored(seen, admissible=admissible)
        ep.advance(drafted.action or FALLBACK_ACTION, await env.step(drafted.action or FALLBACK_ACTION))
        if drafted.action is not None and expert is not None:
            states.append(PlayedState(t, expert, s, seen, admissible, drafted, ep.current.observation, prefix))
    return states


async def reflect_played(
    ctx: Any, game: Any, st: PlayedState, branch: Any, branch_lock: asyncio.Lock, failed: str | None
) -> CounterfactualRow:
    """The four reflections on the draft played at ``st``."""

    async def expert_answer() -> str:
        async with branch_lock:  # restore and step as one: the game's other states share the branch
            await branch.restore(game, st.prefix)
            return (await branch.step(st.expert)).observation

    return await reflect_under_futures(ctx, game, "played", st, st.drafted, st.real, expert_answer, failed)


async def counterfactual_game(
    ctx: Any, env: Any, branch: Any, game: Any, seed: int, slots: asyncio.Semaphore | None = None
) -> list[CounterfactualRow]:
    """The counterfactual rows of one game: its walkthrough states', then its played states' (each
    kind's model calls go out together, at most ``slots`` states at a time; the play itself drafts
    one state after another, each draft's state being the previous draft's outcome)."""
    states = await walkthrough_states(ctx, env, branch, game, 0, seed)
    if not states:
        return []
    plan = [st.expert for st in states]
    failed = await failure_answer(branch, game, states[0])
    lock = asyncio.Lock()
    rows = await each_state(states, lambda st: reflect_walkthrough(ctx, game, st, plan, branch, lock, failed), slots)
    played = await played_states(ctx, env, game)
    rows += await each_state(played, lambda st: reflect_played(ctx, game, st, branch, lock, failed), slots)
    return [r for r in rows if r is not None]


def _future_figures(rows: Sequence[CounterfactualRow], key: str) -> dict[str, Any]:
    shown = [r for r in rows if key in r.p]
    read = [r for r in shown if r.p[key] is not None]
    wrong = [r.p[key] for r in read if not r.draft_match]
    right = [r.p[key] for r in read if r.draft_match]
    works = [r.p[key] for r in read if not r.draft_fails]
    return {
        "states": len(shown),
        "readable": len(read),
        "p_wrong_draft": _mean(wrong),
        "p_right_draft": _mean(right),
        "p_draft_works": _mean(works),
        "p_auc_wrong": auc(wrong, right),
        "gate_open_rate": _mean([float(r.revised[key]) for r in shown]),
        "executed_accuracy": _mean([float(r.executed_match[key]) for r in shown]),
    }


def _against_imagined(rows: Sequence[CounterfactualRow], key: str) -> dict[str, Any]:
    """``|delta p|`` and gate decisions that flip between ``imagined`` and ``key``, by draft kind."""
    out: dict[str, Any] = {}
    for kind, keep in (
        ("all", lambda r: True),
        ("right", lambda r: r.draft_match),
        ("wrong", lambda r: not r.draft_match),
    ):
        both = [r for r in rows if keep(r) and key in r.p]
        deltas = [
            r.p[key] - r.p["imagined"] for r in both if r.p.get(key) is not None and r.p.get("imagined") is not None
        ]
        out[kind] = {
            "states": len(both),
            "mean_abs_delta_p": _mean([abs(d) for d in deltas]),
            "mean_delta_p": _mean(deltas),
            "decision_flips": sum(r.revised[key] != r.revised["imagined"] for r in both),
        }
    return out


def _summary(rows: Sequence[CounterfactualRow]) -> dict[str, Any]:
    return {
        "states": len(rows),
        "games": len({r.game for r in rows}),
        "right_drafts": sum(r.draft_match for r in rows),
        "failing_drafts": sum(r.draft_fails for r in rows),
        "futures": {key: _future_figures(rows, key) for key in FUTURES},
        "against_imagined": {key: _against_imagined(rows, key) for key in FUTURES if key != "imagined"},
    }


def summarize_counterfactual(rows: Sequence[CounterfactualRow]) -> dict[str, Any]:
    """The ``counterfactual`` section of ``eval.json``: the figures per future and against ``imagined``
    of the walkthrough states at the top level (as before the played states were probed: reports and
    their readers keep it), and the same of the played states under ``played`` (None without any)."""
    played = [r for r in rows if r.kind == "played"]
    return {
        **_summary([r for r in rows if r.kind == "walkthrough"]),
        "played": _summary(played) if played else None,
    }


def _table(summary: dict[str, Any], heading: str) -> list[str]:
    def f(x: float | None) -> str:
        return "   n/a" if x is None else f"{x:6.3f}"

    out = [
        f"{heading}: {summary['states']} states of {summary['games']} games "
        f"({summary['right_drafts']} right drafts, {summary['failing_drafts']} failing)",
        "future         p(wrong) p(right)  AUC  gate-open exec-acc  |dp| vs imagined (right / wrong)  flips",
    ]
    for key in FUTURES:
        fig = summary["futures"][key]
        vs = summary["against_imagined"].get(key)
        if vs:
            right, wrong = vs["right"]["mean_abs_delta_p"], vs["wrong"]["mean_abs_delta_p"]
            delta = f"{f(right)} / {f(wrong)}         {vs['all']['decision_flips']:5d}"
        else:
            delta = "      -                             -"
        out.append(
            f"{key:<14} {f(fig['p_wrong_draft'])}  {f(fig['p_right_draft'])} {f(fig['p_auc_wrong'])} "
            f"{f(fig['gate_open_rate'])}   {f(fig['executed_accuracy'])}   {delta}"
        )
    return out


def counterfactual_lines(summary: dict[str, Any]) -> list[str]:
    """The tables ``comap eval --probes --counterfactual`` prints: the walkthrough states' (headed as
    before), then the policy's played states' where there are any."""
    out = _table(summary, "counterfactual")
    if summary.get("played"):
        out += ["", *_table(summary["played"], "counterfactual, the policy's played states")]
    return out


def rows_as_dicts(rows: Sequence[CounterfactualRow]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) for r in rows]
