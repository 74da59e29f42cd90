"""The learn step: losses on micro-batches, one AdamW step, EMA teacher update (DESIGN.md section 6).

A micro-batch is a dict of store name -> records as the broker serves them:
``transitions`` (world model: CE on ``s_next``, KL on the stored rollout ``s_hat_exec``),
``demos`` (policy draft CE on the expert action) and ``reflections`` (policy reflection CE + BCE).
Whatever stores a micro-batch holds are trained; the phase decides what the loop fetches.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from comap_async.config import LearnerConfig
from learner import losses
from learner.batches import Encoder, collate, logits_window
from learner.ema import ema_update, paired_lora_tensors
from learner.model import TRAINED, activate, adapter_parameters


class StepAborted(RuntimeError):
    """A step stopped before its update because the learner is shutting down."""


def rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def cosine_with_warmup(step: int, total: int, warmup_ratio: float, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up, cosine decay to ``floor`` at ``total`` steps, flat afterwards."""
    warm = max(1, int(total * warmup_ratio))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Trainer:
    model: Any
    encoder: Encoder
    cfg: LearnerConfig
    device: str = "cpu"
    step: int = 0
    _pairs: list = field(default_factory=list, init=False)
    abort: bool = False  # set from another thread: the step in flight stops at its next micro-batch

    def __post_init__(self) -> None:
        params = [p for role in TRAINED for _, p in adapter_parameters(self.model, role)]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_with_warmup(s, self.cfg.total_steps, self.cfg.warmup_ratio)
        )
        self._pairs = paired_lora_tensors(self.model)
        # Held while the weights change (optimizer, EMA, step): a checkpoint taken from another thread
        # during a step sees the state after the previous one, with the RNG as that step left it.
        self.update_lock = threading.Lock()
        self.rng_at_step_start = rng_state()
        self.pad_id = self.encoder.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.encoder.tokenizer.eos_token_id

    # ------------------------------------------------------------------ forward passes
    def _logits(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Logits of the last ``keep`` positions only, and the batch's labels/starts shifted to match."""
        keep = logits_window(batch)
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"], logits_to_keep=keep).logits
        offset = batch["input_ids"].shape[1] - keep
        win = {"labels": batch["labels"][:, offset:], "starts": batch["starts"] - offset, "lengths": batch["lengths"]}
        if "change_labels" in batch:
            win["change_labels"] = batch["change_labels"][:, offset:]
        return logits, win

    def world_model_losses(self, records: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, int, float | None]:
        """(CE on real next states, KL(teacher || student) on rollout tokens, tokens processed,
        NLL on the change tokens of the real next states: a metric, None when there are none)."""
        enc = self.encoder
        ce_seqs = [enc.world_model_ce(r) for r in records]
        pairs = [p for p in (enc.world_model_rollout(r) for r in records) if p is not None]
        teacher_logits = None
        if pairs:
            t_batch = collate([t for _, t in pairs], self.pad_id, self.device)
            activate(self.model, "wm_teacher", trainable=False)
            with torch.no_grad():
                t_all, t_win = self._logits(t_batch)
            pos, _ = losses.rollout_positions(t_win["starts"], t_win["lengths"], t_all.shape[1])
            teacher_logits = losses.gather_positions(t_all, pos)
            del t_all
        activate(self.model, "wm", trainable=True)
        batch = collate(ce_seqs, self.pad_id, self.device)
        logits, win = self._logits(batch)
        ce = losses.masked_token_ce(logits, win["labels"])
        change_nll = None
        if "change_labels" in win and bool((win["change_labels"] != losses.IGNORE).any()):
            with torch.no_grad():
                change_nll = float(losses.masked_token_ce(logits.detach(), win["change_labels"]))
        tokens = int(batch["attention_mask"].sum())
        kl = losses._zero(logits)
        if pairs:
            # the student's rollout rows go in their own forward: their windows differ from the CE rows'
            s_batch = collate([s for s, _ in pairs], self.pad_id, self.device)
            s_logits, s_win = self._logits(s_batch)
            pos, mask = losses.rollout_positions(s_win["starts"], s_win["lengths"], s_logits.shape[1])
            kl = losses.self_distillation_kl(losses.gather_positions(s_logits, pos), teacher_logits, mask)
            tokens += int(s_batch["attention_mask"].sum())
        return ce, kl, tokens, change_nll

    def policy_losses(self, demos: list[dict[str, Any]], reflections: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        """(draft CE, reflection CE, revise BCE, tokens processed) with the policy adapter."""
        enc = self.encoder
        seqs = [enc.draft(r) for r in demos] + [enc.reflection(r) for r in reflections]
        activate(self.model, "policy", trainable=True)
        batch = collate(seqs, self.pad_id, self.device)
        logits, win = self._logits(batch)
        nd = len(demos)
        draft_ce = losses.masked_token_ce(logits[:nd], win["labels"][:nd])
        reflect_ce = losses.masked_token_ce(logits[nd:], win["labels"][nd:])
        decision_pos = win["starts"][nd:] - 1
        decision_logits = logits[nd:][torch.arange(len(reflections)), decision_pos]
        y = torch.tensor([int(r["y"]) for r in reflections], device=logits.device)
        bce = losses.revise_bce(decision_logits, enc.keep_id, enc.revise_id, y)
        return draft_ce, reflect_ce, bce, int(batch["attention_mask"].sum())

    # ------------------------------------------------------------------ the step
    def train_step(self, micro_batches: list[dict[str, list[dict[str, Any]]]]) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` (gradient accumulation), then the EMA update."""
        t0 = time.perf_counter()
        self.model.train()
        sums: dict[str, float] = {}
        tokens = 0
        scale = 1.0 / len(micro_batches)

        def add(name: str, value: torch.Tensor) -> None:
            sums[name] = sums.get(name, 0.0) + float(value.detach()) * scale

        change_nlls: list[float] = []  # a metric over the micro-batches that have change tokens

        for mb in micro_batches:
            if self.abort:
                self.optimizer.zero_grad(set_to_none=True)
                raise StepAborted(f"step {self.step + 1} abandoned (shutdown)")
            wm_records = mb.get("transitions") or []
            if wm_records:
                ce, kl, n, change_nll = self.world_model_losses(wm_records)
                loss = losses.world_model_loss(ce, kl, self.cfg.eta)
                (loss * scale).backward()
                add("wm/ce", ce), add("wm/kl", kl), add("wm/loss", loss)
                if change_nll is not None:
                    change_nlls.append(change_nll)
                tokens += n
            demos, refl = mb.get("demos") or [], mb.get("reflections") or []
            if demos or refl:
                draft_ce, reflect_ce, bce, n = self.policy_losses(demos, refl)
                c = self.cfg
                loss = losses.policy_loss(draft_ce, reflect_ce, bce, c.draft_weight, c.reflect_weight, c.bce_weight)
                (loss * scale).backward()
                add("policy/draft_ce", draft_ce), add("policy/reflect_ce", reflect_ce)
                add("policy/bce", bce), add("policy/loss", loss)
                tokens += n
        if change_nlls:
            sums["wm/change_nll"] = sum(change_nlls) / len(change_nlls)
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0) if params else torch.tensor(0.0)
        with self.update_lock:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            ema_update(self._pairs, self.cfg.ema_momentum)
            self.step += 1
            self.rng_at_step_start = rng_state()
        self.model.eval()
        dt = time.perf_counter() - t0
        truncated, self.encoder.truncated = self.encoder.truncated, 0
        return {**sums, "learner/truncated": truncated, "learner/grad_norm": float(grad_norm), "learner/lr": self.scheduler.get_last_lr()[0],
                "learner/tokens": tokens, "learner/tokens_per_s": tokens / dt if dt > 0 else 0.0,
                "learner/step_s": dt}
