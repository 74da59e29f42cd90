"""Evaluation methods other than the CoMap loop: the baselines of the paper's main table, played on
the same games with the same adapters (or the base model) and the same budget of steps.

* ``react``: a short thought, then the action, from the state alone (policy; no world model, no
  reflection) - one model call per step; two with ``actor.admissible_choice`` (the thought, then the
  action decoded among the admissible commands).
* ``imagine_and_act``: the policy's draft, the world model's imagined consequence of it, then a
  final action chosen by the policy from that (no KEEP/REVISE decision, so no action gate) -
  three calls per step.
* ``draft_only``: the policy's draft executed as is - one call per step.
* ``lookahead``: WebEvolver's imagination engine (:mod:`actors.lookahead`) - ``K`` drafts, ``K x D``
  world-model calls, up to ``K x (D - 1)`` more drafts and ``K`` critic calls per step.

``comap`` itself is :func:`actors.episodes.play_coevolve` in evaluation mode. Nothing is stored.
With ``actor.admissible_choice`` every method's executed action is decoded among the state's admissible
commands (the draft, ReAct's action, Imagine-and-Act's final one, the look-ahead's candidates, the repeat
guard's), so the methods differ in what they read and do, not in how an action is decoded;
:mod:`evaluator.roles_read` says what each role reads.
"""

from __future__ import annotations

from typing import Any

from actors import lookahead
from actors.cycles import cycle_stop_for
from actors.episodes import FALLBACK_ACTION, Episode, EpisodeContext, EpisodeStats
from comap_async.facts import state_delta_f1
from comap_async.prompts import turns_of
from comap_async.wire.messages import COEVOLVE

REACT_MAX_TOKENS = 96
"""Tokens of a ReAct answer: a one-sentence thought and the action line (at most the server's
``inference.max_new_tokens``, which refuses a longer request)."""


async def _act(ctx: EpisodeContext, ep: Episode, method: str, s: str) -> tuple[str | None, str | None]:
    """``(action, s_hat)`` of one step (action None: unparseable); ``s_hat`` is the imagined state of the executed
    action when the method imagined it (Imagine-and-Act keeping its candidate), else None."""
    llm = ctx.llm
    if method == "lookahead":
        action, seen = await lookahead.choose(ctx, ep, FALLBACK_ACTION)
        ep.stats.lookahead.append(seen)
        return action, None
    if method == "react":
        budget = min(REACT_MAX_TOKENS, ctx.cfg.inference.max_new_tokens)
        action, _ = await llm.react(s, budget, ep.current.admissible)
        return action, None
    admissible = ep.current.admissible
    seen = ep.draft_state()
    draft, _ = await llm.draft(seen, admissible=admissible)
    if method == "draft_only":
        return draft, None
    if method != "imagine_and_act":
        raise ValueError(f"unknown evaluation method {method!r} (comap runs in actors.episodes.play_coevolve)")
    if draft is None:
        ep.stats.parse_problems += 1
        draft = FALLBACK_ACTION
    s_hat = await llm.imagine(s, draft, turns_of(seen))
    final, _ = await llm.choose(s, draft, s_hat, admissible)
    if final is None:  # no usable answer: the candidate stands
        ep.stats.parse_problems += 1
        return draft, s_hat
    if final != draft:
        ep.stats.revisions += 1
        return final, None
    return final, s_hat


async def play_method(ctx: EpisodeContext, env: Any, game: Any, episode_id: str, method: str) -> EpisodeStats:
    """One evaluation episode of ``method`` (``react``, ``imagine_and_act``, ``draft_only`` or ``lookahead``)."""
    ep = Episode(ctx, game, episode_id, await env.reset(game))
    cycles = cycle_stop_for(ctx.cfg, method, ctx.cycle_check)
    while not ep.current.done:
        s, admissible = ep.state(), ep.current.admissible
        if cycles is not None and cycles.stop(s, ep.stats):
            break
        action, s_hat = await _act(ctx, ep, method, s)
        if action is None:
            ep.stats.parse_problems += 1
            action = FALLBACK_ACTION
        ep.stats.invalid += bool(admissible) and action not in admissible
        ep.advance(action, await env.step(action))
        if s_hat is not None:  # the world model's Delta-F1 where its prediction was of the executed action
            score = state_delta_f1(ctx.next_state, ep.facts_before, s_hat, ep.current.observation)
            if score is not None:
                ep.stats.delta_f1.append(score)
    if cycles is not None:
        cycles.finish(ep.stats)
    return await ep.finish(COEVOLVE, eval_mode=True)
