"""The learn step: losses on micro-batches, one AdamW step, EMA teacher update (docs/design.md section 6).

A micro-batch is a dict of store name -> records as the broker serves them:
``transitions`` (world model: CE on ``s_next``, KL on the stored rollout ``s_hat_exec``),
``demos`` (policy draft CE on the expert action) and ``reflections`` (policy reflection CE + BCE).
Whatever stores a micro-batch holds are trained; the phase decides what the loop fetches. Each is read
once into its typed batches (:func:`learner.batch_types.micro_batch`), and every loss the step
differentiates or logs is :func:`learner.losses.step_loss`'s composition of the terms.

The learning rate follows the phase (:class:`learner.schedule.PhaseSchedule`): warm-up SFT, reflection-mode
initialisation and co-evolution each get their own linear warm-up and cosine decay over their
own step budget. Gradients are clipped per role, so a large world-model gradient never shrinks
the policy's update (or the other way round).

The losses are computed from the positions that carry them: the decoder runs over packed rows
(:func:`learner.packing.pack`: a transition's CE target and its rollout share one pass over their
prompt; attention per unit, :func:`learner.peft_model.packed_attention`), projects only the positions
that predict a target token, and goes through a micro-batch in chunks of ``learner.chunk_tokens`` whose
backward runs right after their forward (each term is a sum over the chunk divided by the micro-batch's
count, so loss and gradient are the whole micro-batch's). On CPU its LoRA dropout draws cheaper masks
(:class:`learner.peft_model.FastDropout`). The forward passes, and ``learner.autocast``'s bf16, are
:class:`learner.forward.Forward`'s. The reference computation (left-padded batches, one causal-LM pass
per kind of row, a window of final positions projected onto the whole vocabulary) is a test oracle:
tests/fixtures/reference_path.py; tests/unit/test_learner_fast_path.py holds these losses and
gradients to it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from comap_async.config import LearnerConfig, MethodConfig
from comap_async.method.routing import world_model_terms
from learner import losses
from learner.batch_types import (
    DraftBatch,
    MicroBatch,
    PolicySample,
    Records,
    ReflectionBatch,
    WorldModelBatch,
    WorldModelUnit,
    draft_batch,
    micro_batch,
    policy_samples,
    reflection_batch,
    world_model_batch,
)
from learner.batches import Encoder
from learner.checkpoint import rng_state
from learner.ema import copy_student_to_teacher, ema_update, paired_lora_tensors
from learner.forward import Forward, per_sequence
from learner.packing import chunk_by_tokens, pack
from learner.paw import AdaptiveWeight, policy_wm_aux_term
from learner.peft_model import (
    TRAINED,
    activate,
    adapter_parameters,
)
from learner.schedule import MAX_GRAD_NORM, PhaseSchedule, clip_per_role


class StepAborted(RuntimeError):
    """A step stopped before its update because the learner is shutting down."""


@dataclass
class Trainer:
    model: Any
    encoder: Encoder
    cfg: LearnerConfig
    device: str = "cpu"
    method: MethodConfig = field(default_factory=MethodConfig)
    """The method's section: the losses' weights, the BCE's labels and balance, the EMA teacher's momentum."""
    step: int = 0
    _pairs: list = field(default_factory=list, init=False)
    abort: bool = False  # set from another thread: the step in flight stops at its next micro-batch (or chunk)
    ablation: list[str] = field(default_factory=list)
    """The ablations switched on (``cfg.method.ablation``): ``no_wmsd`` / ``no_real_ce`` drop a world-model loss
    term (it is then neither computed nor logged)."""
    label_counts: list[float] = field(default_factory=lambda: [0, 0])
    """Reflection samples trained on so far with y = 0 and y = 1 (``method.bce_balance``'s weights)."""
    data_parallel: Any = None
    """A :class:`learner.distributed.DataParallel` under torchrun: gradients and label counts are
    averaged/summed over the ranks before each optimizer step."""
    freeze_wm: bool = False
    """Set per step by the learner (the ablation ``frozen_wm`` after warm-up): the world model is not
    trained (its records are ignored) and the EMA teacher is not updated."""
    paw_entropy: str = "prompt"
    """Whose action entropy selects PaW's transitions (``learner.policy_wm_aux``): ``prompt`` or ``acting``,
    set by the learner from the prompt form (:func:`learner.paw.paw_entropy`)."""

    def __post_init__(self) -> None:
        self.role_params = {role: [p for _, p in adapter_parameters(self.model, role)] for role in TRAINED}
        params = [p for role in TRAINED for p in self.role_params[role]]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.0)
        self.scheduler = PhaseSchedule(self.optimizer, self.cfg)
        self._pairs = paired_lora_tensors(self.model)
        # Held while the weights change (optimizer, EMA, step): a checkpoint taken from another thread
        # during a step sees the state after the previous one, with the RNG as that step left it.
        self.update_lock = threading.Lock()
        self.rng_at_step_start = rng_state()
        self.pad_id = self.encoder.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.encoder.tokenizer.eos_token_id
        self.paw_weight = AdaptiveWeight(self.cfg.policy_wm_aux)
        self.forward = Forward(self.model, self.cfg, self.pad_id, self.device)

    def start_teacher(self) -> None:
        """Make the EMA teacher a copy of the student. Co-evolution calls it when it begins: the paper
        instantiates the teacher after warm-up, so the world-state gate does not compare the warmed-up
        student with a teacher that lags it by the EMA's ~100 steps."""
        with self.update_lock:
            copy_student_to_teacher(self._pairs)

    # ------------------------------------------------------------------ the batches
    def micro_batch(self, records: Records) -> MicroBatch:
        """A served micro-batch's typed batches (the world model's empty while it is frozen); the
        reflection samples' BCE weights are the step's to set (:meth:`weigh`)."""
        real_ce, distill = world_model_terms(self.ablation)
        return micro_batch(
            self.encoder,
            records,
            real_ce=real_ce,
            distill=distill,
            bce_gate_labels=self.method.bce_gate_labels,
            train_world_model=not self.freeze_wm,
        )

    def weigh(self, reflections: ReflectionBatch) -> ReflectionBatch:
        """``reflections`` with their BCE weights (``method.bce_balance``, from the label counts so far)."""
        weights = self.bce_weights(torch.tensor(reflections.y, dtype=torch.long))
        reflections.weight = None if weights is None else weights.tolist()
        return reflections

    @property
    def loss_weights(self) -> losses.LossWeights:
        """The weights :func:`learner.losses.step_loss` composes this step's terms with."""
        c = self.method
        return losses.LossWeights(draft=c.draft_weight, reflect=c.reflect_weight, bce=c.bce_weight, eta=c.eta)

    def _wm_terms(self, ce: losses.Term, kl: losses.Term) -> losses.StepTerms:
        """The world-model terms an ablation keeps (a dropped one is neither in the loss nor logged)."""
        real_ce, distill = world_model_terms(self.ablation)
        return losses.StepTerms(wm_ce=ce if real_ce else None, wm_kl=kl if distill else None)

    # ------------------------------------------------------------------ the sums
    # Each term is summed over a chunk of sequences (one forward), then divided by the
    # micro-batch's count: chunks give the same loss and gradient as one pass, with the
    # activations of one chunk alive at a time (learner.chunk_tokens).

    def _wm_sums(self, units: list[WorldModelUnit]) -> dict[str, Any]:
        """The world-model terms summed over ``units`` (one teacher pass, one student pass)."""
        teachers = [u.teacher for u in units if u.teacher is not None]
        teacher_logits = self.teacher_logits(teachers) if teachers else None
        activate(self.model, "wm", trainable=True)
        packed = pack([u.seqs for u in units], self.pad_id, self.device)
        logits = self.forward.target_logits(packed)
        is_ce = [flag for u in units for flag in u.is_ce]
        ce_rows = torch.tensor(is_ce, device=logits.device)[packed.owner]
        n_ce = int(ce_rows.sum())
        out = {
            "ce": losses.token_ce(logits[ce_rows], packed.targets[ce_rows]) * n_ce,
            "n_ce": n_ce,
            "kl": losses._zero(logits),
            "n_kl": 0,
            "change": 0.0,
            "n_change": 0,
            "tokens": packed.tokens,
        }
        if packed.change is not None:
            sel = ce_rows & packed.change
            n = int(sel.sum())
            if n:
                with torch.no_grad():
                    out["change"] = float(losses.token_ce(logits.detach()[sel], packed.targets[sel])) * n
                    out["n_change"] = n
        if teachers:
            counts = [c for c, flag in zip(packed.counts, is_ce) if not flag]
            student, mask = per_sequence(logits[~ce_rows], counts)
            out["kl"] = losses.self_distillation_kl(student, teacher_logits, mask) * sum(counts)
            out["n_kl"] = sum(counts)
        return out

    def _policy_sums(self, samples: list[PolicySample]) -> dict[str, Any]:
        """The policy terms summed over ``samples`` (:func:`learner.batch_types.policy_samples`)."""
        activate(self.model, "policy", trainable=True)
        packed = pack([[s.seq] for s in samples], self.pad_id, self.device)
        logits = self.forward.target_logits(packed)
        is_draft = torch.tensor([s.y is None for s in samples], device=logits.device)[packed.owner]
        n_draft = int(is_draft.sum())
        n_reflect = len(packed.targets) - n_draft
        refl = [i for i, s in enumerate(samples) if s.y is not None]
        # the decision position predicts the reflection's first target token (`` KEEP``/`` REVISE``):
        # the BCE trains the choice there, the reflection's text term only that a decision word comes
        at = torch.tensor([packed.first[i] for i in refl], dtype=torch.long, device=logits.device)
        decision_logits = logits[at]
        labelled = [j for j, i in enumerate(refl) if samples[i].in_bce]  # the decisions whose y trains p
        in_bce = [samples[refl[j]] for j in labelled]
        y = torch.tensor([s.y for s in in_bce], device=logits.device)
        weight = None  # unweighted unless method.bce_balance gave the samples weights
        if in_bce and in_bce[0].weight is not None:
            weight = torch.tensor([s.weight for s in in_bce], device=logits.device)
        keep_id, revise_id = self.encoder.keep_id, self.encoder.revise_id
        bce = losses.revise_bce(decision_logits[labelled], keep_id, revise_id, y, weight)
        text = ~is_draft
        text[at] = False
        n_text = int(text.sum())
        reflect = (
            losses.token_ce(logits[text], packed.targets[text]) * n_text
            + losses.decision_format_nll(decision_logits, keep_id, revise_id).sum()
        )
        return {
            "draft": losses.token_ce(logits[is_draft], packed.targets[is_draft]) * n_draft,
            "n_draft": n_draft,
            "reflect": reflect,
            "n_reflect": n_reflect,
            "bce": bce * len(labelled),
            "n_bce": len(labelled),
            "tokens": packed.tokens,
        }

    def bce_weights(self, y: torch.Tensor) -> torch.Tensor | None:
        """Per reflection sample, its BCE weight under ``method.bce_balance`` (None: unweighted)."""
        if not self.method.bce_balance:
            return None
        return losses.label_balance_weights(y, (self.label_counts[0], self.label_counts[1]))

    def _check_abort(self) -> None:
        if self.abort:
            self.optimizer.zero_grad(set_to_none=True)
            raise StepAborted(f"step {self.step + 1} abandoned (shutdown)")

    def _world_model_step(self, batch: WorldModelBatch, scale: float) -> tuple[dict[str, float], int, float | None]:
        """Forward and backward of the world-model loss of one micro-batch: (metrics, tokens, change NLL)."""
        if not batch.units:  # nothing left to train on (self-distillation only, and no rollouts in these records)
            return {}, 0, None
        n_ce, n_kl = max(batch.n_ce, 1), max(batch.n_kl, 1)
        total = {"ce": 0.0, "kl": 0.0, "change": 0.0, "n_change": 0, "tokens": 0}
        for chunk in chunk_by_tokens(self.cfg.chunk_tokens, batch.units, lambda u: u.length):
            self._check_abort()
            part = self._wm_sums(chunk)
            loss, _ = losses.step_loss(self._wm_terms(part["ce"] / n_ce, part["kl"] / n_kl), self.loss_weights)
            (loss * scale).backward()
            for k in total:
                total[k] += float(part[k].detach()) if isinstance(part[k], torch.Tensor) else part[k]
        _, metrics = losses.step_loss(self._wm_terms(total["ce"] / n_ce, total["kl"] / n_kl), self.loss_weights)
        change_nll = total["change"] / total["n_change"] if total["n_change"] else None
        return metrics, int(total["tokens"]), change_nll

    def _policy_step(
        self, drafts: DraftBatch, reflections: ReflectionBatch, scale: float
    ) -> tuple[dict[str, float], int]:
        """Forward and backward of the policy loss of one micro-batch: (metrics, tokens)."""
        samples = policy_samples(drafts, reflections)
        if not samples:  # every path of the micro-batch was cut before its first demonstrated action
            return losses.step_loss(losses.StepTerms(draft_ce=0.0, reflect_ce=0.0, bce=0.0), self.loss_weights)[1], 0
        n_draft, n_reflect, n_bce = max(1, drafts.n_loss), max(1, reflections.n_loss), max(1, reflections.n_bce)
        total = {"draft": 0.0, "reflect": 0.0, "bce": 0.0, "tokens": 0}
        for chunk in chunk_by_tokens(self.cfg.chunk_tokens, samples, lambda sample: sample.length):
            self._check_abort()
            part = self._policy_sums(chunk)
            terms = losses.StepTerms(
                draft_ce=part["draft"] / n_draft, reflect_ce=part["reflect"] / n_reflect, bce=part["bce"] / n_bce
            )
            loss, _ = losses.step_loss(terms, self.loss_weights)
            (loss * scale).backward()
            for k in total:
                total[k] += float(part[k].detach()) if isinstance(part[k], torch.Tensor) else part[k]
        terms = losses.StepTerms(
            draft_ce=total["draft"] / n_draft, reflect_ce=total["reflect"] / n_reflect, bce=total["bce"] / n_bce
        )
        return losses.step_loss(terms, self.loss_weights)[1], int(total["tokens"])

    def _policy_wm_aux_step(
        self, transitions: list[dict[str, Any]], scale: float, policy_loss: float
    ) -> dict[str, float]:
        """PaW (learner/paw.py): forward and backward of the policy's weighted auxiliary world-model term."""
        aux = policy_wm_aux_term(self, transitions)
        if aux is None:
            return {}
        term, selection = aux
        weight = self.paw_weight.update(policy_loss, float(term.detach()))
        loss, metrics = losses.step_loss(
            losses.StepTerms(wm_aux=term), dataclasses.replace(self.loss_weights, wm_aux=weight)
        )
        (loss * scale).backward()
        return metrics | selection

    def world_model_losses(self, records: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, int, float | None]:
        """(CE on real next states, KL(teacher || student) on rollout tokens, tokens processed,
        NLL on the change tokens of the real next states: a metric, None when there are none)."""
        return self.world_model_batch_losses(
            world_model_batch(self.encoder, records, *world_model_terms(self.ablation))
        )

    def world_model_batch_losses(self, batch: WorldModelBatch) -> tuple[torch.Tensor, torch.Tensor, int, float | None]:
        """:meth:`world_model_losses` of a typed batch, in one pass (a training step goes through
        :meth:`_world_model_step`'s chunks)."""
        if not batch.units:
            zero = torch.zeros((), device=self.device)
            return zero, zero, 0, None
        part = self._wm_sums(batch.units)
        change_nll = part["change"] / part["n_change"] if part["n_change"] else None
        return part["ce"] / max(part["n_ce"], 1), part["kl"] / max(part["n_kl"], 1), part["tokens"], change_nll

    def teacher_logits(self, seqs: list) -> torch.Tensor:
        """The EMA teacher's logits on its rollout tokens [B, L, V], without gradient or dropout.

        The teacher is the distillation target, not a model being trained: in train mode LoRA
        dropout would make the target itself noisy. The model's mode is restored afterwards.
        """
        activate(self.model, "wm_teacher", trainable=False)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                packed = pack([[s] for s in seqs], self.pad_id, self.device)
                return per_sequence(self.forward.target_logits(packed), packed.counts)[0]
        finally:
            self.model.train(was_training)

    def policy_losses(self, demos: list[dict[str, Any]], reflections: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        """(draft CE, reflection CE, revise BCE, tokens processed) with the policy adapter."""
        drafts = draft_batch(self.encoder, demos)
        return self.policy_batch_losses(
            drafts, self.weigh(reflection_batch(self.encoder, reflections, self.method.bce_gate_labels))
        )

    def policy_batch_losses(self, drafts: DraftBatch, reflections: ReflectionBatch) -> tuple[torch.Tensor, ...]:
        """:meth:`policy_losses` of typed batches, in one pass (a training step goes through
        :meth:`_policy_step`'s chunks)."""
        part = self._policy_sums(policy_samples(drafts, reflections))
        return (
            part["draft"] / max(part["n_draft"], 1),
            part["reflect"] / max(part["n_reflect"], 1),
            part["bce"] / max(part["n_bce"], 1),
            part["tokens"],
        )

    # ------------------------------------------------------------------ the step
    def train_step(self, micro_batches: list[dict[str, list[dict[str, Any]]]]) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` (gradient accumulation), then the EMA update."""
        t0 = time.perf_counter()
        self.model.train()
        sums: dict[str, float] = {}
        tokens = 0
        scale = 1.0 / len(micro_batches)

        def add(name: str, value: float) -> None:
            sums[name] = sums.get(name, 0.0) + value * scale

        change_nlls: list[float] = []  # a metric over the micro-batches that have change tokens
        batches = [self.micro_batch(mb) for mb in micro_batches]
        labels = [0, 0]  # reflection samples trained with y = 0, y = 1
        for batch in batches:
            labels = [a + b for a, b in zip(labels, batch.reflections.label_counts())]
        # counted before the loss, over every rank's samples: the step's own samples weigh in its balance
        seen = self.data_parallel.sum(labels) if self.data_parallel is not None else labels
        self.label_counts = [self.label_counts[0] + seen[0], self.label_counts[1] + seen[1]]

        for batch in batches:
            self._check_abort()
            if batch.world_model.units:
                metrics, n, change_nll = self._world_model_step(batch.world_model, scale)
                for name, value in metrics.items():
                    add(name, value)
                if change_nll is not None:
                    change_nlls.append(change_nll)
                tokens += n
            if batch.drafts.records or batch.reflections.seqs:
                metrics, n = self._policy_step(batch.drafts, self.weigh(batch.reflections), scale)
                for name, value in metrics.items():
                    add(name, value)
                tokens += n
                if self.cfg.policy_wm_aux > 0 and batch.transitions:  # PaW (learner/paw.py)
                    self._check_abort()
                    for name, value in self._policy_wm_aux_step(
                        batch.transitions, scale, metrics["policy/loss"]
                    ).items():
                        add(name, value)
        if self.data_parallel is not None:
            self.data_parallel.average_gradients([p for params in self.role_params.values() for p in params])
        if change_nlls:
            sums["wm/change_nll"] = sum(change_nlls) / len(change_nlls)
        if sum(labels):  # the label mix the reflection mode actually saw this step
            sums["policy/revise_label_share"] = labels[1] / sum(labels)
        norms = clip_per_role(self.role_params, MAX_GRAD_NORM)
        with self.update_lock:
            lr = self.scheduler.apply(self.step)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if not self.freeze_wm:
                ema_update(self._pairs, self.method.ema_momentum)
            self.step += 1
            self.rng_at_step_start = rng_state()
        self.model.eval()
        dt = time.perf_counter() - t0
        truncated, self.encoder.truncated = self.encoder.truncated, 0
        demo_actions, self.encoder.demo_actions = self.encoder.demo_actions, 0
        return {
            **sums,
            "learner/truncated": truncated,
            "policy/demo_actions": demo_actions,
            "policy/imagined_demos": sum(batch.drafts.imagined for batch in batches),
            "learner/lr": lr,
            "learner/grad_norm": math.sqrt(sum(v * v for v in norms.values())),
            "learner/grad_norm_policy": norms["policy"],
            "learner/grad_norm_wm": norms["wm"],
            "learner/tokens": tokens,
            "learner/tokens_per_s": tokens / dt if dt > 0 else 0.0,
            "learner/step_s": dt,
        }
