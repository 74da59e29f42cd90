"""CoMap loss terms, one small pure function each (docs/design.md section 6).

Shapes: ``logits`` [B, T, V]; ``labels`` [B, T] with -100 where a token is not a target. Every
function returns a scalar tensor averaged over the tokens (or samples) that count, and 0 (still
differentiable) when nothing counts, so a micro-batch without such tokens adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from comap_async.method.decision import revise_logit

IGNORE = -100


def _zero(like: torch.Tensor) -> torch.Tensor:
    return like.sum() * 0.0


def masked_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over target tokens only (prompt and padding are -100)."""
    shift_logits = logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE
    if not mask.any():
        return _zero(logits)
    return F.cross_entropy(shift_logits[mask].float(), shift_labels[mask])


def token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` [N, V] (the positions that predict a target token only) against
    ``targets`` [N], averaged over the N tokens: :func:`masked_token_ce` without the positions
    that carry no loss (the learner projects only these)."""
    if targets.numel() == 0:
        return _zero(logits)
    return F.cross_entropy(logits.float(), targets)


def gather_positions(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``logits[b, positions[b, j]]`` -> [B, L, V] (positions clipped into range by the caller)."""
    idx = positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return torch.gather(logits, 1, idx)


def rollout_positions(starts: torch.Tensor, lengths: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions whose logits predict rollout token j (``start + j - 1``) and the validity mask.

    ``starts[b]`` is where sample b's rollout begins in its sequence, ``lengths[b]`` how many
    rollout tokens it has. Returns ([B, L], [B, L]) with L = max length.
    """
    width = int(lengths.max().item()) if lengths.numel() else 0
    j = torch.arange(width, device=starts.device).unsqueeze(0)
    mask = j < lengths.unsqueeze(1)
    pos = (starts.unsqueeze(1) + j - 1).clamp(0, seq_len - 1)
    return pos, mask


def self_distillation_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Token-level ``KL(teacher || student)`` averaged over the masked (rollout) tokens.

    Both logits are [B, L, V] aligned on the same rollout tokens; the teacher carries no gradient.
    """
    if not mask.any():
        return _zero(student_logits)
    s_logp = F.log_softmax(student_logits[mask].float(), dim=-1)
    t_logp = F.log_softmax(teacher_logits[mask].detach().float(), dim=-1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    return kl.mean()


def revise_bce(
    decision_logits: torch.Tensor, keep_id: int, revise_id: int, y: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Binary cross-entropy of the revise probability ``p`` against the gate label ``y`` (0/1), averaged
    over the samples (each multiplied by ``weight`` when given: :func:`label_balance_weights`). ``p`` is
    the sigmoid of :func:`comap_async.method.decision.revise_logit`, the one the actor's gate reads; the
    loss takes that logit itself, which stays exact for confident logits where ``log p`` would not."""
    if decision_logits.shape[0] == 0:
        return _zero(decision_logits)
    logit = revise_logit(decision_logits[:, keep_id], decision_logits[:, revise_id])
    per_sample = F.binary_cross_entropy_with_logits(logit, y.to(logit.dtype), reduction="none")
    return (per_sample if weight is None else per_sample * weight).mean()


def label_balance_weights(y: torch.Tensor, counts: tuple[float, float]) -> torch.Tensor:
    """Per-sample BCE weights under which the labels seen so far (``counts``: y = 0, y = 1) weigh
    alike: ``n / (2 n_y)``, 1 for both when they are equally frequent. Without them a skewed label
    mix (72 % REVISE in a CPU run's reflection-mode initialisation) is learned as a prior, the same
    ``p`` for every state, which no threshold can use."""
    n0, n1 = max(counts[0], 1), max(counts[1], 1)
    per_label = torch.tensor([(n0 + n1) / (2 * n0), (n0 + n1) / (2 * n1)], device=y.device)
    return per_label[y.long()]


def decision_format_nll(decision_logits: torch.Tensor, keep_id: int, revise_id: int) -> torch.Tensor:
    """``-log(P(KEEP) + P(REVISE))`` at the decision position, per sample [B]: that a decision word
    comes at all, whichever. Its gradient reaches the two words' logits only through their mean (the
    half-difference is held fixed), so it pushes both alike and never moves ``p``: the choice between
    them is trained by :func:`revise_bce` only (docs/design.md section 6), while the text stays readable."""
    logits = decision_logits.float()
    keep, revise = logits[:, keep_id], logits[:, revise_id]
    mid, half = (keep + revise) / 2, ((revise - keep) / 2).detach()
    pair = torch.stack([mid - half, mid + half], dim=-1)  # the two logits' values, moved only together
    mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[[keep_id, revise_id]] = True
    others = logits.masked_fill(mask, float("-inf"))
    return torch.logsumexp(torch.cat([others, pair], dim=-1), dim=-1) - torch.logsumexp(pair, dim=-1)


def world_model_loss(ce: torch.Tensor, kl: torch.Tensor, eta: float) -> torch.Tensor:
    """``CE(s' | s, a) + eta * KL(teacher || student)``."""
    return ce + eta * kl


def policy_loss(
    draft_ce: torch.Tensor,
    reflect_ce: torch.Tensor,
    bce: torch.Tensor,
    draft_weight: float = 1.0,
    reflect_weight: float = 1.0,
    bce_weight: float = 0.01,
) -> torch.Tensor:
    """Expert-draft anchor + gated reflection CE + weighted BCE on the revise probability."""
    return draft_weight * draft_ce + reflect_weight * reflect_ce + bce_weight * bce


Term = torch.Tensor | float
"""A loss term: a tensor to differentiate, or its value (a float) to log."""


@dataclass(frozen=True)
class LossWeights:
    """The weights of a learner step's loss terms."""

    draft: float = 1.0
    """``method.draft_weight``: the expert-draft anchor's CE."""
    reflect: float = 1.0
    """``method.reflect_weight``: the reflection's CE."""
    bce: float = 0.01
    """``method.bce_weight``: the BCE on ``p``."""
    eta: float = 0.5
    """``method.eta``: self-distillation's KL beside the world model's CE."""
    wm_aux: float = 0.0
    """PaW's adaptive weight of the policy's auxiliary world-model term (learner/paw.py)."""


@dataclass(frozen=True)
class StepTerms:
    """A learner step's loss terms, each the mean over the tokens (or samples) it counts, or a chunk's
    share of that mean (its sum over the chunk divided by the micro-batch's count); None: not in this
    loss (not computed, not logged)."""

    wm_ce: Term | None = None
    """The world model's CE on the real next state (:func:`token_ce`)."""
    wm_kl: Term | None = None
    """Self-distillation, KL(teacher || student) on the student's rollout (:func:`self_distillation_kl`)."""
    draft_ce: Term | None = None
    """The policy's CE on demonstrated actions (:func:`token_ce`)."""
    reflect_ce: Term | None = None
    """The policy's CE on the reflection's text, with the decision position's format term
    (:func:`token_ce`, :func:`decision_format_nll`)."""
    bce: Term | None = None
    """The BCE of ``p`` against the decision label (:func:`revise_bce`)."""
    wm_aux: Term | None = None
    """PaW: the policy's generalized CE on next observations (:func:`learner.paw.generalized_ce`)."""


def _value(term: Term) -> float:
    return float(term.detach()) if isinstance(term, torch.Tensor) else float(term)


def step_loss(terms: StepTerms, weights: LossWeights) -> tuple[Term, dict[str, float]]:
    """The loss of ``terms`` (the one composition of the learner's terms: world model
    ``CE + eta * KL``, policy ``draft CE + reflection CE + bce_weight * BCE``, PaW's weighted auxiliary
    term; a term that is None adds nothing) and its namespaced metrics (``wm/*``, ``policy/*``).
    Tensors give the loss to differentiate, floats the values to log."""
    total: Term | None = None
    metrics: dict[str, float] = {}
    if terms.wm_ce is not None or terms.wm_kl is not None:
        ce = 0.0 if terms.wm_ce is None else terms.wm_ce
        kl = 0.0 if terms.wm_kl is None else terms.wm_kl
        world_model = world_model_loss(ce, kl, weights.eta)
        if terms.wm_ce is not None:
            metrics["wm/ce"] = _value(ce)
        if terms.wm_kl is not None:
            metrics["wm/kl"] = _value(kl)
        metrics["wm/loss"] = _value(world_model)
        total = world_model
    if terms.draft_ce is not None or terms.reflect_ce is not None or terms.bce is not None:
        draft = 0.0 if terms.draft_ce is None else terms.draft_ce
        reflect = 0.0 if terms.reflect_ce is None else terms.reflect_ce
        bce = 0.0 if terms.bce is None else terms.bce
        policy = policy_loss(draft, reflect, bce, weights.draft, weights.reflect, weights.bce)
        metrics |= {
            "policy/draft_ce": _value(draft),
            "policy/reflect_ce": _value(reflect),
            "policy/bce": _value(bce),
            "policy/loss": _value(policy),
        }
        total = policy if total is None else total + policy
    if terms.wm_aux is not None:
        aux = weights.wm_aux * terms.wm_aux
        metrics |= {"policy/wm_aux": _value(terms.wm_aux), "policy/wm_aux_weight": weights.wm_aux}
        total = aux if total is None else total + aux
    return (0.0 if total is None else total), metrics
