"""Branches (docs/design.md section 11): a step's alternatives played out from a restored state under the
continuation policy, the game's expert. They label reflection-mode initialisation's samples and judge
evaluated steps (URR, HRR, BRP)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from comap_async.method.gates import canonical_action
from comap_async.method.labels import branch_outcome

if TYPE_CHECKING:
    from actors.episodes import Episode


async def play_branch(env: Any, game: Any, prefix: list[str], first: str, plan: list[str]) -> tuple[Any, str]:
    """One branch (docs/design.md section 11): restore the state after ``prefix`` on ``env``, take
    ``first``, then continue under the continuation policy, the game's expert, until the episode
    ends (won, or ``env.max_steps`` counted from the start of the episode). The expert is
    walkthrough-consistent: while the branch has followed the game's walkthrough ``plan`` exactly
    it takes the walkthrough's next command, off it the handcoded expert's (which never begins
    with its reset-time ``look``). Returns the :class:`~comap_async.method.labels.BranchResult` and
    the real observation right after ``first``."""
    await env.restore(game, prefix)
    r = await env.step(first)
    after, steps = r.observation, 1
    taken = [*prefix, first]
    on_plan = taken == plan[: len(taken)]
    while not r.done:
        if on_plan and len(taken) < len(plan):
            action = plan[len(taken)]
        else:
            on_plan, action = False, r.expert_action
        if action is None:  # the expert gave up: the branch ends unsolved
            break
        r = await env.step(action)
        taken.append(action)
        steps += 1
    return branch_outcome(r.won, steps), after


def expert_plan_action(ep: "Episode", plan: list[str]) -> str | None:
    """The demonstration's action at the episode's current state: the walkthrough while the episode
    follows it, then the handcoded expert (as in warm-up; no leading ``look``)."""
    t = ep.stats.steps
    if t < len(plan) and ep.actions == plan[:t]:
        return plan[t]
    return ep.current.expert_action


async def judge_step(
    branch: Any, game: Any, prefix: list[str], a_draft: str, a_ref: str, plan: list[str]
) -> tuple[int, int]:
    """``(z_draft, z_ref)`` of one evaluated state: whether the branch started by the draft / by the
    reflected action wins (same continuation, same horizon; one rollout when they are equal)."""
    d_result, _ = await play_branch(branch, game, prefix, a_draft, plan)
    if not a_ref.strip() or canonical_action(a_ref) == canonical_action(a_draft):
        return int(d_result.won), int(d_result.won)
    r_result, _ = await play_branch(branch, game, prefix, a_ref, plan)
    return int(d_result.won), int(r_result.won)
