"""The world model as an imagination engine at inference (WebEvolver, arXiv 2504.21024, its
``call_web.py``): several candidate actions, each played a few steps ahead in the world model's
imagination, scored by the policy acting as critic; the best-scored candidate is executed.

Per step, with ``K = eval.lookahead_k`` and ``D =`` :data:`DEPTH`:

1. ``K`` drafts sampled at :data:`TEMPERATURE` are the candidates (a canonical duplicate
   is played once; an unparseable draft is dropped; none left: the fallback command);
2. for each candidate the world model answers ``D`` times: the candidate, then the policy's draft
   from each imagined state (the imagined state is the real history plus the imagined pairs, without
   an admissible list: the environment has not said what it would accept there);
3. the policy, as critic, reads the state and the imagined continuation and answers YES or NO to
   "does this bring the task closer to done?"; the score is P(YES) over the two answer tokens;
4. the candidate with the highest score is executed (the first sampled one on a tie or when no
   score can be read).

The world model is called ``K x D`` times per step when every draft parses (fewer candidates after
deduplication). Nothing is trained from it; it is an evaluation method beside the paper's baselines.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from comap_async.method.gates import canonical_action
from comap_async.prompts import turns_of

DEPTH = 1
"""Imagined steps per candidate (the world model answers each; the policy drafts the next action from
the imagined state). WebEvolver looks ahead one to a few steps."""
TEMPERATURE = 0.7
"""Temperature of the candidates' drafts: distinct candidates need sampling, also when the evaluation is
greedy."""


@dataclass(frozen=True, slots=True)
class LookaheadStep:
    candidates: tuple[str, ...]
    scores: tuple[float | None, ...]
    chosen: int
    """Index of the executed candidate."""


async def imagine_ahead(ctx: Any, ep: Any, candidate: str, depth: int) -> list[tuple[str, str]]:
    """The imagined continuation ``[(action, imagined observation), ...]`` starting with ``candidate``."""
    state, seen, action, out = ep.state(), ep.draft_state(), candidate, []
    for d in range(depth):
        observation = await ctx.llm.imagine(state, action, turns_of(seen))
        out.append((action, observation))
        if d + 1 == depth:
            break
        state, seen = ep.imagined_state(out), ep.draft_state(out)  # the draft's view: the same, or the turns
        action, _ = await ctx.llm.draft(seen)
        if action is None:  # the policy has nothing to say in that imagined state: the continuation ends
            break
    return out


async def choose(ctx: Any, ep: Any, fallback: str) -> tuple[str, LookaheadStep]:
    """The executed action of one step, and what the look-ahead saw."""
    ev, llm, s = ctx.cfg.eval, ctx.llm, ep.state()
    seen = ep.draft_state()
    admissible = ep.current.admissible
    drafts = await asyncio.gather(*(llm.draft(seen, TEMPERATURE, admissible) for _ in range(ev.lookahead_k)))
    candidates: list[str] = []
    for action, _ in drafts:
        if action is not None and canonical_action(action) not in {canonical_action(c) for c in candidates}:
            candidates.append(action)
    if not candidates:
        ep.stats.parse_problems += 1
        return fallback, LookaheadStep((fallback,), (None,), 0)
    futures = await asyncio.gather(*(imagine_ahead(ctx, ep, c, DEPTH) for c in candidates))
    scores = await asyncio.gather(*(llm.critic(s, future) for future in futures))
    best = max(range(len(candidates)), key=lambda i: (scores[i] if scores[i] is not None else -1.0, -i))
    return candidates[best], LookaheadStep(tuple(candidates), tuple(scores), best)
