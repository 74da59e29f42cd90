"""One frozen base model with three LoRA adapters: ``policy``, ``wm`` and its EMA twin ``wm_teacher``."""

from __future__ import annotations

from typing import Any

import torch

from comap_async.wire.messages import POLICY, WM

TRAINED = (POLICY, WM)


def build_peft_model(
    base: Any,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.05,
    target_modules: Any = "all-linear",
    gradient_checkpointing: bool = False,
) -> Any:
    """Wrap ``base`` with the three adapters; base weights are frozen, the teacher starts as the student."""
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        # non-reentrant: works with frozen inputs (only LoRA tensors need grad) and keeps dropout's RNG
        kwargs = {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    from learner.ema import copy_student_to_teacher, paired_lora_tensors

    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg, adapter_name="policy")
    model.add_adapter("wm", cfg)
    model.add_adapter("wm_teacher", cfg)
    copy_student_to_teacher(paired_lora_tensors(model))
    for name, p in model.named_parameters():
        p.requires_grad_(False)
    return model


def cast_frozen_base(model: Any, dtype: torch.dtype) -> int:
    """Keep the frozen weights of every LoRA-wrapped linear layer in ``dtype`` (the bf16 autocast
    of the learner's fast path): the matmuls that dominate a step then read bf16 weights instead
    of casting fp32 ones at every call. The LoRA tensors (trained, EMA, checkpointed, published)
    and the norms and embeddings keep their dtype. Every forward must then run under autocast,
    which also picks the LoRA matmuls' dtype (peft's own input cast is switched off).
    Returns how many tensors were cast."""
    from peft.tuners.lora import LoraLayer

    cast = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            for name in ("weight", "bias"):
                t = getattr(base, name, None)
                if t is not None and t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
                    cast += 1
            module.cast_input_dtype_enabled = False
    return cast


class _KeepAndScale(torch.autograd.Function):
    """``where(keep, x, 0) * scale`` with one output tensor, and the same for its gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.where(keep, x, 0).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, 0).mul_(ctx.scale), None, None


class FastDropout(torch.nn.Module):
    """Inverted dropout like ``nn.Dropout(p)``, with its mask drawn from 64-bit random words cut
    into four 16-bit ones: half the time of ``bernoulli_`` on a CPU core (LoRA dropout runs on the
    input of every adapted linear layer, and was 15 % of a bf16 step). ``p`` is rounded to a
    multiple of 2^-16; the draws come from torch's default generator (checkpointed, reproducible).
    The backward keeps a bool mask (``nn.Dropout`` keeps one of the input's dtype). Under
    autocast the input is cast first (the LoRA matmul that follows would cast it anyway)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} not in [0, 1)")
        self.p = p
        self.threshold = -32768 + round(p * 65536)  # int16 draws below it are dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        kind = x.device.type
        if torch.is_autocast_enabled(kind) and x.is_floating_point():
            x = x.to(torch.get_autocast_dtype(kind))
        n = x.numel()
        words = torch.empty(((n + 3) // 4,), dtype=torch.int64, device=x.device).random_(-(2**63), None)
        keep = words.view(torch.int16)[:n].view(x.shape) >= self.threshold
        return _KeepAndScale.apply(x, keep, 1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


def use_fast_dropout(model: Any) -> int:
    """Replace every LoRA layer's ``nn.Dropout`` by :class:`FastDropout` with the same ``p``
    (on CPU; CUDA's fused dropout is fast already). Returns how many were replaced."""
    from peft.tuners.lora import LoraLayer

    replaced = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, drop in list(module.lora_dropout.items()):
                if type(drop) is torch.nn.Dropout and drop.p > 0:
                    fast = FastDropout(drop.p)
                    fast.train(drop.training)
                    module.lora_dropout[name] = fast
                    replaced += 1
    return replaced


PACKED_ATTENTION = "comap_packed_sdpa"


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_layout: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA that follows a :class:`learner.packing.Packed` layout instead of its dense mask.

    The dense [W, W] mask of a packed row makes the kernel compute every query-key block, and
    most of them are masked (other units, the upper triangle). Here each unit's prompt attends
    to itself with a causal kernel and each target attends to the keys from its prompt's start
    to its own end with a small mask; padding gets zeros. The result is the dense mask's
    (tests/unit/test_learner_fast_path.py). Without ``packed_layout`` (any other forward) this
    is transformers' SDPA.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads, width, dim = query.shape[1], query.shape[2], query.shape[3]
    gqa = key.shape[1] != heads
    rows = []
    for r, units in enumerate(packed_layout):
        pieces, at = [], 0
        q, k, v = query[r : r + 1], key[r : r + 1], value[r : r + 1]
        for unit in units:
            off, p = unit.offset, unit.prompt
            if off > at:
                pieces.append(query.new_zeros((1, heads, off - at, dim)))
            pieces.append(
                sdpa(
                    q[:, :, off : off + p],
                    k[:, :, off : off + p],
                    v[:, :, off : off + p],
                    dropout_p=dropout,
                    is_causal=True,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
            at = off + p
            for start, n, seen in unit.branches:
                end = start + n
                pieces.append(
                    sdpa(
                        q[:, :, start:end],
                        k[:, :, off:end],
                        v[:, :, off:end],
                        attn_mask=seen,
                        dropout_p=dropout,
                        scale=scaling,
                        enable_gqa=gqa,
                    )
                )
                at = end
        if at < width:
            pieces.append(query.new_zeros((1, heads, width - at, dim)))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def use_packed_attention(model: Any) -> bool:
    """Route the model's attention through :func:`packed_attention` (only from SDPA, the default;
    forwards without a layout stay SDPA). Returns whether it did."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    config = model.get_base_model().config
    if config._attn_implementation == PACKED_ATTENTION:
        return True
    if config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    config._attn_implementation = PACKED_ATTENTION
    return True


def adapter_parameters(model: Any, role: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The LoRA tensors of one adapter, in a stable order (optimizer state depends on it)."""
    return [(n, p) for n, p in model.named_parameters() if f".{role}." in n and "lora_" in n]


def activate(model: Any, role: str, trainable: bool) -> None:
    """Route forward passes through ``role``'s adapter; only its tensors require grad when trainable."""
    model.set_adapter(role)
    for _, p in model.named_parameters():
        p.requires_grad_(False)
    if trainable:
        for _, p in adapter_parameters(model, role):
            p.requires_grad_(True)


def adapter_state(model: Any, role: str) -> dict[str, torch.Tensor]:
    """peft's state dict of one adapter (the on-disk format the inference servers load)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=role).items()}


def load_adapter_state(model: Any, role: str, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state, adapter_name=role)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise ValueError(f"adapter {role}: unexpected tensors in checkpoint: {unexpected[:3]}")
