"""Fact-set arithmetic behind Delta-F1 and the world-state gate (pure functions).

An environment's parser turns observation text into a set of canonical facts (strings such as
``at(countertop 1)``) or ``None`` when it cannot read the text. An action's effect is the set of
*changes* between the facts before and after it: ``+fact`` for a fact that appeared, ``-fact``
for one that disappeared. Comparing changes rather than whole states scores what the action did,
not how much of an unchanged room a prediction happened to repeat.

The facts compared are those of the **state** (docs/design.md section 11), not of one observation:
an environment's ``next_state(state, text)`` applies an observation to the facts known so far
(a receptacle's contents seen earlier are still facts after the agent walks away), so a new
observation that merely stops mentioning something does not count as a change. Actors keep one
state per episode, send it with each transition (``facts``), and the broker, evaluation and the
checks score predictions with :func:`state_delta_f1` against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Facts = frozenset[str]
NextState = Callable[[Facts, str], "Facts | None"]
"""An environment's state update: the state's facts after observing a text; None if unreadable."""

NO_CHANGE = "nochange()"
"""A parser's fact for text that reports a failed or informational action (ALFWorld's
``Nothing happens.``): the state after it is the state before, so it induces no change. It is
dropped from a *before* set, where it carries no state."""


def fact_changes(before: Iterable[str], after: Iterable[str]) -> frozenset[str]:
    """Signed symmetric difference: ``+f`` for facts gained, ``-f`` for facts lost."""
    b, a = frozenset(before) - {NO_CHANGE}, frozenset(after)
    if NO_CHANGE in a:
        return frozenset()
    return frozenset({"+" + f for f in a - b} | {"-" + f for f in b - a})


def set_f1(predicted: Iterable[str], reference: Iterable[str]) -> float:
    """F1 between two sets; two empty sets agree perfectly (1.0), one empty set scores 0."""
    p, r = frozenset(predicted), frozenset(reference)
    if not p and not r:
        return 1.0
    tp = len(p & r)
    if tp == 0:
        return 0.0
    precision, recall = tp / len(p), tp / len(r)
    return 2 * precision * recall / (precision + recall)


def changes_f1(before: Facts, after_a: Facts, after_b: Facts) -> float:
    """``set_f1(fact_changes(before, after_a), fact_changes(before, after_b))`` without building
    the signed change sets (the broker computes it for every transition).

    A change is shared when both sides gained the same fact (in both, not before) or lost the
    same fact (before, in neither); the sizes are those of the one-sided differences.
    """
    if after_a is after_b or after_a == after_b:
        return 1.0  # identical predictions: identical changes (both empty agrees too)
    b = before - {NO_CHANGE} if NO_CHANGE in before else before
    a_none, b_none = NO_CHANGE in after_a, NO_CHANGE in after_b
    n_a = 0 if a_none else len(after_a - b) + len(b - after_a)
    n_b = 0 if b_none else len(after_b - b) + len(b - after_b)
    if n_a == 0 and n_b == 0:
        return 1.0
    if a_none or b_none:
        return 0.0
    tp = len((after_a & after_b) - b) + len(b - after_a - after_b)
    if tp == 0:
        return 0.0
    precision, recall = tp / n_a, tp / n_b  # the same arithmetic as set_f1: bit-identical scores
    return 2 * precision * recall / (precision + recall)


def delta_f1(prev_facts: Facts | None, predicted_facts: Facts | None, real_facts: Facts | None) -> float:
    """Delta-F1: F1 between the predicted and the real action-induced fact changes.

    ``predicted_facts is None`` means the prediction could not be parsed and scores 0. When the
    previous or real observation is unreadable there is no reference, which is a caller error.
    """
    if prev_facts is None or real_facts is None:
        raise ValueError("delta_f1 needs parseable previous and real observations")
    if predicted_facts is None:
        return 0.0
    return set_f1(fact_changes(prev_facts, predicted_facts), fact_changes(prev_facts, real_facts))


def state_delta_f1(next_state: NextState, before: Facts, predicted: str, real: str) -> float | None:
    """Delta-F1 of a predicted next observation at the state level (docs/design.md section 11):
    ``F1(C(ŝ') ⊖ C(s), C(s') ⊖ C(s))`` where ``C(ŝ')`` and ``C(s')`` are the state ``before``
    updated by the predicted and by the real observation.

    ``None`` when the real observation is unreadable (no reference: not a score); an unreadable
    prediction scores 0."""
    after_real = next_state(before, real)
    if after_real is None:
        return None
    after_pred = next_state(before, predicted)
    if after_pred is None:
        return 0.0
    return changes_f1(before, after_pred, after_real)
