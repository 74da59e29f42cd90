"""The learner's forward passes: logits for the losses, on either code path (learner/trainer.py).

The reference path runs the causal LM over left-padded batches and projects a window of final
positions onto the whole vocabulary (:meth:`Forward.window_logits`). The fast path runs the decoder
over packed rows (:func:`learner.packing.pack`; attention per unit,
:func:`learner.peft_model.packed_attention`) and projects only the positions that predict a target
token (:meth:`Forward.target_logits`); with ``learner.prompt_grad: false`` the prompts' keys and
values come from a pass without gradient. ``learner.autocast`` adds bf16 matmuls on hardware that
has them (:func:`resolve_autocast`). Which adapter answers is the caller's choice
(:func:`learner.peft_model.activate`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from comap_async.config import LearnerConfig
from comap_async.models import cpu_has_native_bf16, kv_cache_argument
from learner.batches import logits_window
from learner.packing import Packed, detach_prompts
from learner.peft_model import cast_frozen_base, use_fast_dropout, use_packed_attention


def resolve_autocast(mode: str, device: str | torch.device) -> torch.dtype | None:
    """``learner.autocast`` -> the autocast dtype of the learner's forward passes (None: fp32)."""
    if mode == "off":
        return None
    if mode == "bf16":
        return torch.bfloat16
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    if kind == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else None
    return None


@dataclass
class Forward:
    model: Any
    cfg: LearnerConfig
    pad_id: int
    device: str = "cpu"
    amp_dtype: torch.dtype | None = field(init=False)
    packed_attention: bool = field(init=False, default=False)
    """Whether the fast path's packed rows attend per unit (the model's attention is SDPA)."""

    def __post_init__(self) -> None:
        self.amp_dtype = resolve_autocast(self.cfg.autocast, self.device)
        if self.amp_dtype is not None:
            cast_frozen_base(self.model, self.amp_dtype)
        if self.cfg.fast_path:
            if getattr(self.model.get_base_model().config, "final_logit_softcapping", None):
                raise ValueError(
                    "learner.fast_path projects hidden states with the output embeddings only; "
                    "this model soft-caps its logits: set learner.fast_path: false"
                )
            self.packed_attention = use_packed_attention(self.model)
            if torch.device(self.device).type == "cpu":
                use_fast_dropout(self.model)

    def amp(self) -> contextlib.AbstractContextManager:
        """The autocast context of every forward pass (a no-op in fp32)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.amp_dtype)

    def window_logits(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The reference path: logits of the last ``keep`` positions only, and the batch's
        labels/starts shifted to match."""
        keep = logits_window(batch)
        with self.amp():
            logits = self.model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
                logits_to_keep=keep,
            ).logits
        offset = batch["input_ids"].shape[1] - keep
        win = {"labels": batch["labels"][:, offset:], "starts": batch["starts"] - offset, "lengths": batch["lengths"]}
        if "change_labels" in batch:
            win["change_labels"] = batch["change_labels"][:, offset:]
        return logits, win

    def target_logits(self, packed: Packed) -> torch.Tensor:
        """The fast path: the decoder's hidden states over the packed rows, then the vocabulary
        projection (fp32) of the positions that predict a target token only: [N, V]."""
        if not self.cfg.prompt_grad and torch.is_grad_enabled() and min(u[0].start for u in packed.units) > 1:
            return self._detached_prompt_logits(packed)
        layout = {"packed_layout": packed.layout} if self.packed_attention else {}
        with self.amp():
            hidden = (
                self.model.get_base_model()
                .get_decoder()(
                    input_ids=packed.input_ids,
                    attention_mask=packed.attention_mask,
                    position_ids=packed.position_ids,
                    use_cache=False,
                    **layout,
                )
                .last_hidden_state
            )
        return self._vocabulary(hidden[packed.rows, packed.cols])

    def _vocabulary(self, h: torch.Tensor) -> torch.Tensor:
        """The output embeddings' projection (fp32 logits) of the hidden states that predict targets."""
        head = self.model.get_base_model().get_output_embeddings()
        return torch.nn.functional.linear(h.to(head.weight.dtype), head.weight, head.bias).float()

    def _detached_prompt_logits(self, packed: Packed) -> torch.Tensor:
        """:meth:`target_logits` with ``learner.prompt_grad: false``: the prompts' keys and values
        from a pass without gradient, then the targets' pass against them (:func:`detach_prompts`).
        The same logits; no gradient through the prompts' keys and values."""
        det = detach_prompts(packed.units, self.pad_id, self.device)
        decoder = self.model.get_base_model().get_decoder()
        cache_arg = kv_cache_argument(decoder)
        with torch.no_grad(), self.amp():
            context = decoder(
                input_ids=det.context_ids,
                attention_mask=det.context_mask,
                position_ids=det.context_pos,
                use_cache=True,
            )
        cache = getattr(context, cache_arg)
        cache.batch_select_indices(det.unit_of)  # one context row per sequence of the unit
        with self.amp():
            hidden = decoder(
                input_ids=det.tail_ids,
                attention_mask=det.tail_mask,
                position_ids=det.tail_pos,
                use_cache=True,
                **{cache_arg: cache},
            ).last_hidden_state
        return self._vocabulary(hidden[det.rows, det.cols])


def per_sequence(flat: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] rows of consecutive sequences -> ([B, L, V] zero-padded, [B, L] validity mask):
    the layout of :func:`learner.losses.rollout_positions` and :func:`learner.losses.self_distillation_kl`."""
    lengths = torch.tensor(counts, device=flat.device)
    width = max(counts) if counts else 0
    mask = torch.arange(width, device=flat.device).unsqueeze(0) < lengths.unsqueeze(1)
    out = flat.new_zeros((len(counts), width, flat.shape[-1]))
    out[mask] = flat
    return out, mask
