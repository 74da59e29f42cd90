"""The gate's ``p`` and ``q``, each one function (comap_async/method/decision.py): the actor's floats
and the learner's tensors give the same ``p``, and the learner's BCE is the log-loss of that ``p``."""

from __future__ import annotations

import math

import pytest
import torch

from comap_async.method.decision import (
    revise_logit,
    revise_probability,
    sequence_confidence,
    top_k_revise_probability,
)
from comap_async.prompts import DecisionTokens
from learner import losses

# (keep, revise) log-scores: ordinary, equal, a common offset (logprobs vs logits), confident either
# way, and the extremes where exp overflows a double (|d| > 709)
PAIRS = [
    (-1.2, -0.3),
    (0.5, 0.5),
    (-2.3, -1.2),
    (101.2, 102.3),
    (-20.0, 15.0),
    (15.0, -20.0),
    (0.0, 700.0),
    (0.0, -700.0),
    (700.0, -700.0),
    (-700.0, 700.0),
    (-1e-12, 1e-12),
]


def two_way_softmax(keep: float, revise: float) -> float:
    """P(REVISE) / (P(REVISE) + P(KEEP)) written out, in exact-enough long arithmetic."""
    top = max(keep, revise)
    k, r = math.exp(keep - top), math.exp(revise - top)
    return r / (k + r)


@pytest.mark.parametrize("keep, revise", PAIRS)
def test_p_is_a_two_way_softmax_and_the_float_and_tensor_paths_agree(keep, revise):
    p = revise_probability(keep, revise)
    assert isinstance(p, float) and 0.0 <= p <= 1.0
    assert p == pytest.approx(two_way_softmax(keep, revise), rel=1e-12, abs=1e-300)
    # the learner's path on the same scores: float64 agrees to rounding, float32 (its logits) to float32's
    as64 = revise_probability(torch.tensor([keep], dtype=torch.float64), torch.tensor([revise], dtype=torch.float64))
    assert as64.dtype == torch.float64 and float(as64[0]) == pytest.approx(p, rel=1e-12, abs=1e-300)
    k32, r32 = torch.tensor([keep]), torch.tensor([revise])
    as32 = revise_probability(k32, r32)
    same_inputs = revise_probability(float(k32[0]), float(r32[0]))  # the scores as float32 holds them
    assert as32.dtype == torch.float32 and float(as32[0]) == pytest.approx(same_inputs, rel=1e-6, abs=1e-30)


def test_p_at_the_extremes_is_exactly_zero_or_one_without_overflow():
    assert revise_probability(0.0, 800.0) == 1.0 and revise_probability(800.0, 0.0) == 0.0
    assert revise_probability(-math.inf, 0.0) == 1.0 and revise_probability(0.0, -math.inf) == 0.0
    t = revise_probability(torch.tensor([0.0, 800.0, -700.0]), torch.tensor([800.0, 0.0, 700.0]))
    assert t.tolist() == [1.0, 0.0, 1.0]


def test_half_precision_logits_are_read_in_float32():
    keep, revise = torch.tensor([20.0], dtype=torch.bfloat16), torch.tensor([20.125], dtype=torch.bfloat16)
    d = revise_logit(keep, revise)
    assert d.dtype == torch.float32 and float(d[0]) == pytest.approx(0.125)
    assert float(revise_probability(keep, revise)[0]) == pytest.approx(revise_probability(20.0, 20.125), rel=1e-6)


def test_the_learners_bce_is_the_log_loss_of_the_same_p():
    torch.manual_seed(3)
    logits = torch.randn(7, 9) * 4
    keep, revise = 2, 5
    # confident and wrong either way (d = -700 labelled REVISE, +700 labelled KEEP), and confident and right
    logits[4, [keep, revise]] = torch.tensor([350.0, -350.0])
    logits[5, [keep, revise]] = torch.tensor([-350.0, 350.0])
    logits[6, [keep, revise]] = torch.tensor([-30.0, 30.0])
    y = torch.tensor([1, 0, 1, 0, 1, 0, 1])
    per = []
    for i in range(len(y)):
        k, r = float(logits[i, keep]), float(logits[i, revise])
        p, p_keep = revise_probability(k, r), revise_probability(r, k)  # p_keep: 1 - p, kept exact near p = 1
        assert p + p_keep == pytest.approx(1.0)
        bce = losses.revise_bce(logits[i : i + 1], keep, revise, y[i : i + 1])
        assert bce.item() == pytest.approx(-math.log(p if y[i] else p_keep), rel=1e-5, abs=1e-6)
        per.append(bce)
    assert per[4].item() == pytest.approx(700.0) and per[5].item() == pytest.approx(700.0)
    weights = torch.tensor([0.5, 2.0, 1.0, 1.0, 0.0, 1.0, 3.0])
    assert losses.revise_bce(logits, keep, revise, y, weights).item() == pytest.approx(
        (torch.stack(per) * weights).mean().item(), rel=1e-6
    )


def test_top_k_p_reads_exactly_the_two_decision_tokens():
    # SmolLM2 splits " REVISE" into " RE"+"V"+"ISE" and " KEEP" into " KE"+"EP"
    d = DecisionTokens(" KE", " RE", 7, 9)
    top = {" RE": math.log(0.3), " KE": math.log(0.1), " the": math.log(0.5)}
    assert top_k_revise_probability(top, d) == pytest.approx(0.75)
    assert top_k_revise_probability(top, d) == revise_probability(top[" KE"], top[" RE"])
    # spelling variants are other tokens: the learner's logits at the two ids do not see them either
    variants = {**top, " keep": math.log(0.05), " Keep": math.log(0.04)}
    assert top_k_revise_probability(variants, d) == pytest.approx(0.75)
    assert top_k_revise_probability({" RE": -1.0, " the": -0.1}, d) == 1.0  # KEEP below every listed token
    assert top_k_revise_probability({" KE": -1.0, " the": -0.1}, d) == 0.0
    assert top_k_revise_probability({" the": -0.1}, d) is None
    assert top_k_revise_probability(None, d) is None


def test_q_is_the_geometric_mean_token_probability():
    assert sequence_confidence([math.log(0.5), math.log(0.8)]) == pytest.approx(math.sqrt(0.4))
    assert sequence_confidence([]) == 0.0
