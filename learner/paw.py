"""PaW (Policy and World modeling co-training, 2026): the **policy** adapter is also trained to
predict the next observation of real transitions (``learner.policy_wm_aux``, off by default).

The description available (no public code) names three parts; what is implemented for each:

* **Which transitions**: those where the policy is least sure of the action that was taken, by
  its action entropy (the mean entropy of its next-token distribution over the executed action's
  tokens, given the draft prompt): the :data:`SHARE` (half) of a micro-batch's real transitions with
  the highest entropy (:func:`select_by_entropy`). In the turns forms (``env.draft_turns``) a transition
  does not carry the conversation its draft saw, so the entropy is the actor's, read as it drafted
  (:func:`acting_entropy`, :attr:`learner.trainer.Trainer.paw_entropy` ``acting``): a one-sample estimate
  from the draft's own tokens, of the policy that acted rather than the one being trained.
* **A noise-tolerant loss**: the generalized cross-entropy of Zhang and Sabuncu (2018) per target
  token, ``(1 - p^q) / q`` (:func:`generalized_ce`, :data:`Q`, 0.7): it tends to
  the cross-entropy as ``q -> 0`` and to the mean absolute error at ``q = 1``, so a few
  observations the policy cannot predict (the game's randomness, unseen receptacles' contents)
  pull less than under the cross-entropy.
* **Adaptive balancing** (the paper gives no formula): the weight keeps the auxiliary term at
  ``learner.policy_wm_aux`` times the size of the policy's own loss, from exponential moving
  averages of both (:class:`AdaptiveWeight`), so it neither vanishes nor swamps the policy as the
  two losses fall at different rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

SHARE = 0.5
"""Share of a micro-batch's real transitions, highest action entropy first, PaW trains on."""
Q = 0.7
"""The generalized cross-entropy's ``q`` (noise tolerance; towards 0 it is the cross-entropy)."""


def paw_entropy(cfg: Any) -> Literal["prompt", "acting"]:
    """Whose action entropy selects under ``cfg`` (a ``CoMapConfig``): ``prompt``, the learner's current
    policy's over the executed action's tokens after the window-form draft prompt of ``s_t``; in the turns
    forms (``env.draft_turns``) ``acting``, the actor's as it drafted (:func:`acting_entropy`; no extra
    forward): their transitions do not carry the conversation the draft saw, and the window-form prompt is
    one their policy never acts on."""
    return "acting" if cfg.env.draft_turns else "prompt"


def select_by_entropy(entropy: torch.Tensor, share: float) -> list[int]:
    """Indices of the ``share`` of rows with the highest entropy (at least one when any), highest first."""
    n = entropy.numel()
    if n == 0:
        return []
    k = max(1, round(share * n))
    return torch.argsort(entropy, descending=True, stable=True)[:k].tolist()


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's softmax [N]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def generalized_ce(logits: torch.Tensor, targets: torch.Tensor, q: float) -> torch.Tensor:
    """Mean over the N target tokens of ``(1 - p_target^q) / q`` (logits [N, V], targets [N])."""
    if targets.numel() == 0:
        return logits.sum() * 0.0
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return ((1.0 - torch.exp(q * logp)) / q).mean()


def acting_entropy(records: list[dict[str, Any]]) -> torch.Tensor:
    """Per record, minus the log of its draft's confidence (the geometric-mean token probability the
    actor read as it drafted): the mean negative log-likelihood of the tokens it sampled, whose
    expectation is the per-token entropy (:func:`paw_entropy` ``acting``)."""
    return -torch.log(torch.tensor([float(r["draft_confidence"]) for r in records], dtype=torch.float32))


@dataclass
class AdaptiveWeight:
    """``base * EMA(policy loss) / EMA(aux loss)``, capped at ``10 * base``."""

    base: float
    momentum: float = 0.9
    policy: float | None = None
    aux: float | None = None

    def update(self, policy_loss: float, aux_loss: float) -> float:
        m = self.momentum
        self.policy = policy_loss if self.policy is None else m * self.policy + (1 - m) * policy_loss
        self.aux = aux_loss if self.aux is None else m * self.aux + (1 - m) * aux_loss
        return min(10 * self.base, self.base * self.policy / max(self.aux, 1e-6))


def policy_wm_aux_term(trainer: Any, records: list[dict[str, Any]]) -> tuple[torch.Tensor, dict[str, float]] | None:
    """Select the micro-batch's transitions by the policy's action entropy, then the generalized
    cross-entropy of their next observations under the policy adapter: (the term, to differentiate,
    and the selection's metrics), None when no transition is usable. The trainer weighs it
    (:class:`AdaptiveWeight`) and composes it with the step's other terms (:func:`learner.losses.step_loss`)."""
    from learner.packing import pack
    from learner.peft_model import activate

    enc, acting = trainer.encoder, trainer.paw_entropy == "acting"
    usable = [r for r in records if r.get("s_next") and r.get("a_exec")]
    if acting:  # only steps whose draft's confidence the actor measured
        usable = [r for r in usable if (r.get("draft_confidence") or 0.0) > 0.0]
    if not usable:
        return None
    if acting:
        per_row = acting_entropy(usable)
    else:
        activate(trainer.model, "policy", trainable=False)
        with torch.no_grad(), trainer.forward.amp():
            packed = pack(
                [[enc.draft({"s": r["s"], "target": r["a_exec"]})] for r in usable], trainer.pad_id, trainer.device
            )
            ent = token_entropy(trainer.forward.target_logits(packed))
            owner = torch.as_tensor(packed.owner, device=ent.device)
            per_row = torch.zeros(len(usable), device=ent.device).index_add_(0, owner, ent)
            per_row = per_row / torch.bincount(owner, minlength=len(usable)).clamp(min=1)
    chosen = select_by_entropy(per_row.cpu(), SHARE)
    activate(trainer.model, "policy", trainable=True)
    packed = pack([[enc.world_model_ce(usable[i])] for i in chosen], trainer.pad_id, trainer.device)
    with trainer.forward.amp():
        loss = generalized_ce(trainer.forward.target_logits(packed), packed.targets, Q)
    return loss, {
        "policy/wm_aux_selected": float(len(chosen)),
        "policy/wm_aux_entropy": float(per_row.mean()),
    }
