"""One frozen base model with three LoRA adapters: ``policy``, ``wm`` and its EMA twin ``wm_teacher``."""

from __future__ import annotations

from typing import Any

import torch

ROLES = ("policy", "wm", "wm_teacher")
TRAINED = ("policy", "wm")


def build_peft_model(base: Any, r: int = 8, alpha: int = 16, dropout: float = 0.05, target_modules: Any = "all-linear",
                     gradient_checkpointing: bool = False) -> Any:
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
