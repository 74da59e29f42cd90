"""The learner's forward passes: logits for the losses (learner/trainer.py).

The decoder runs over packed rows (:func:`learner.packing.pack`; attention per unit,
:func:`learner.peft_model.packed_attention`) and only the positions that predict a target token are
projected onto the vocabulary (:meth:`Forward.target_logits`). ``learner.autocast`` adds bf16 matmuls
on hardware that has them (:func:`resolve_autocast`). Which adapter answers is the caller's choice
(:func:`learner.peft_model.activate`). The reference computation (window logits over left-padded
batches) is a test oracle: tests/fixtures/reference_path.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from comap_async.config import LearnerConfig
from comap_async.models import cpu_has_native_bf16
from learner.packing import Packed
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
    """Whether the packed rows attend per unit (the model's attention is SDPA)."""

    def __post_init__(self) -> None:
        self.amp_dtype = resolve_autocast(self.cfg.autocast, self.device)
        if self.amp_dtype is not None:
            cast_frozen_base(self.model, self.amp_dtype)
        if getattr(self.model.get_base_model().config, "final_logit_softcapping", None):
            raise ValueError(
                "the learner projects hidden states with the output embeddings only: "
                "a model that soft-caps its logits is not supported"
            )
        self.packed_attention = use_packed_attention(self.model)
        if torch.device(self.device).type == "cpu":
            use_fast_dropout(self.model)

    def amp(self) -> contextlib.AbstractContextManager:
        """The autocast context of every forward pass (a no-op in fp32)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.amp_dtype)

    def target_logits(self, packed: Packed) -> torch.Tensor:
        """The decoder's hidden states over the packed rows, then the vocabulary projection (fp32)
        of the positions that predict a target token only: [N, V]."""
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


def per_sequence(flat: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] rows of consecutive sequences -> ([B, L, V] zero-padded, [B, L] validity mask):
    the layout of :func:`learner.losses.rollout_positions` and :func:`learner.losses.self_distillation_kl`."""
    lengths = torch.tensor(counts, device=flat.device)
    width = max(counts) if counts else 0
    mask = torch.arange(width, device=flat.device).unsqueeze(0) < lengths.unsqueeze(1)
    out = flat.new_zeros((len(counts), width, flat.shape[-1]))
    out[mask] = flat
    return out, mask
