"""The action gate's two numbers, each defined once (docs/design.md sections 6 and 11).

* ``p`` = P(REVISE) / (P(REVISE) + P(KEEP)) at the reflection's decision position: the sigmoid of
  the decision logit ``revise - keep``. The actor reads the two scores as a server's logprobs
  (floats), the learner as its logits (tensors); both come here, so the ``p`` the gate thresholds
  is the ``p`` the BCE trains (the learner's BCE takes :func:`revise_logit`).
* ``q`` = the reflected action's confidence, its tokens' geometric-mean probability.

No torch import: the actors run without it. A tensor reaches the tensor branch only from a process
that has torch loaded already.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from comap_async.prompts.template import DecisionTokens


def _sigmoid(x: float) -> float:
    """``1 / (1 + e^-x)`` without overflow at either end (``math.exp`` of a large positive
    argument raises, so the negative side is written as ``e^x / (1 + e^x)``)."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _at_least_float32(t: Tensor) -> Tensor:
    # a bf16 difference of two confident logits rounds away most of p; the learner's logits are bf16
    return t.float() if t.dtype.itemsize < 4 else t


def revise_logit(keep: float | Tensor, revise: float | Tensor) -> float | Tensor:
    """The decision logit ``revise - keep``: ``p``'s log-odds. Floats give a float; tensors (any
    shape, alike) a tensor of at least float32. A softmax over the two scores is the sigmoid of
    their difference, so this is the whole of what the two scores say about ``p``."""
    if isinstance(keep, Real) and isinstance(revise, Real):
        return float(revise) - float(keep)
    return _at_least_float32(revise) - _at_least_float32(keep)


def revise_probability(keep: float | Tensor, revise: float | Tensor) -> float | Tensor:
    """``p`` from the two decision tokens' log-scores (logprobs or logits; their common offset
    cancels): ``sigmoid(revise - keep)``, a float for floats (exact to 0 and 1 at the extremes,
    never overflowing) and ``torch.sigmoid`` of :func:`revise_logit` for tensors."""
    d = revise_logit(keep, revise)
    if isinstance(d, float):
        return _sigmoid(d)
    import torch

    return torch.sigmoid(d)


def top_k_revise_probability(logprobs: Mapping[str, float] | None, decision: DecisionTokens) -> float | None:
    """``p`` from the decision position's top-k alternatives (token text -> logprob, as a server
    reports them; ``decision``: the two tokens, :class:`comap_async.prompts.DecisionTokens`, or
    another yes/no pair such as the look-ahead critic's, ``p`` then being the second one's share).
    A token missing from the top-k has less probability than every listed one and counts as 0;
    None when neither is listed (the reflection cannot be read)."""
    if not logprobs:
        return None
    keep, revise = logprobs.get(decision.keep), logprobs.get(decision.revise)
    if keep is None and revise is None:
        return None
    if keep is None or revise is None:
        return 1.0 if keep is None else 0.0
    return revise_probability(keep, revise)


def sequence_confidence(token_logprobs: Sequence[float]) -> float:
    """``q``: the geometric-mean probability of a sequence's tokens, ``exp(mean logprob)`` (the
    reflected action's ``q_ref``, and the draft's confidence the reflection prompt shows); 0 for an
    empty sequence."""
    if not token_logprobs:
        return 0.0
    return math.exp(sum(token_logprobs) / len(token_logprobs))
