"""The reference path's losses (``learner.fast_path: false``): left-padded batches, one causal-LM pass
per kind of row, a window of final positions projected onto the whole vocabulary. The simplest
reading of each term, and what tests/unit/test_learner_fast_path.py holds the fast path to."""

from __future__ import annotations

from typing import Any

import torch

from comap_async.method.routing import world_model_terms
from learner import losses
from learner.batches import collate
from learner.peft_model import activate


def world_model_losses(tr: Any, records: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, int, float | None]:
    """As :meth:`learner.trainer.Trainer.world_model_losses` (``tr``: the Trainer)."""
    enc, (real_ce, distill) = tr.encoder, world_model_terms(tr.ablation)
    ce_seqs = [enc.world_model_ce(r) for r in records] if real_ce else []
    pairs = [p for p in (enc.world_model_rollout(r) for r in records) if p is not None] if distill else []
    teacher_logits = tr.teacher_logits([t for _, t in pairs]) if pairs else None
    activate(tr.model, "wm", trainable=True)
    ce = kl = torch.zeros((), device=tr.device)  # a dropped term (no gradient)
    change_nll, tokens = None, 0
    if ce_seqs:
        batch = collate(ce_seqs, tr.pad_id, tr.device)
        logits, win = tr.forward.window_logits(batch)
        ce = losses.masked_token_ce(logits, win["labels"])
        if "change_labels" in win and bool((win["change_labels"] != losses.IGNORE).any()):
            with torch.no_grad():
                change_nll = float(losses.masked_token_ce(logits.detach(), win["change_labels"]))
        tokens = int(batch["attention_mask"].sum())
    if pairs:
        # the student's rollout rows go in their own forward: their windows differ from the CE rows'
        s_batch = collate([s for s, _ in pairs], tr.pad_id, tr.device)
        s_logits, s_win = tr.forward.window_logits(s_batch)
        pos, mask = losses.rollout_positions(s_win["starts"], s_win["lengths"], s_logits.shape[1])
        kl = losses.self_distillation_kl(losses.gather_positions(s_logits, pos), teacher_logits, mask)
        tokens += int(s_batch["attention_mask"].sum())
    return ce, kl, tokens, change_nll


def policy_losses(tr: Any, demos: list[dict[str, Any]], reflections: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
    """As :meth:`learner.trainer.Trainer.policy_losses` (``tr``: the Trainer)."""
    enc = tr.encoder
    seqs = [enc.draft(r) for r in demos] + [enc.reflection(r) for r in reflections]
    activate(tr.model, "policy", trainable=True)
    batch = collate(seqs, tr.pad_id, tr.device)
    logits, win = tr.forward.window_logits(batch)
    nd = len(demos)
    draft_ce = losses.masked_token_ce(logits[:nd], win["labels"][:nd])
    rows = torch.arange(len(reflections), device=logits.device)
    decision_pos = win["starts"][nd:] - 1
    decision_logits = logits[nd:][rows, decision_pos]
    # the decision word's own token: the format term instead of its cross-entropy (see _policy_sums)
    text_labels = win["labels"][nd:].clone()
    text_labels[rows, win["starts"][nd:]] = losses.IGNORE
    n_text = int((text_labels[:, 1:] != losses.IGNORE).sum())
    text_ce = losses.masked_token_ce(logits[nd:], text_labels)
    fmt = losses.decision_format_nll(decision_logits, enc.keep_id, enc.revise_id).sum()
    n_reflect = n_text + len(reflections)
    reflect_ce = (text_ce * n_text + fmt) / n_reflect if n_reflect else losses._zero(logits)
    labelled = [j for j, r in enumerate(reflections) if tr.in_bce(r)]
    y = torch.tensor([int(reflections[j]["y"]) for j in labelled], device=logits.device)
    bce = losses.revise_bce(decision_logits[labelled], enc.keep_id, enc.revise_id, y, tr.bce_weights(y))
    return draft_ce, reflect_ce, bce, int(batch["attention_mask"].sum())
