"""EMA teacher: real weight averaging of the world-model LoRA tensors (not a file copy)."""

from __future__ import annotations

import torch

STUDENT, TEACHER = "wm", "wm_teacher"


def paired_lora_tensors(
    model: torch.nn.Module, student: str = STUDENT, teacher: str = TEACHER
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(teacher, student) parameter pairs, matched by name (``...lora_A.wm.weight``)."""
    params = dict(model.named_parameters())
    pairs = []
    for name, p in params.items():
        if f".{teacher}." in name:
            s_name = name.replace(f".{teacher}.", f".{student}.")
            if s_name not in params:
                raise KeyError(f"teacher tensor {name} has no student twin {s_name}")
            pairs.append((p, params[s_name]))
    if not pairs:
        raise ValueError(f"model has no '{teacher}' adapter tensors")
    return pairs


@torch.no_grad()
def ema_update(pairs: list[tuple[torch.Tensor, torch.Tensor]], momentum: float) -> None:
    """teacher <- m * teacher + (1 - m) * student, in place."""
    for t, s in pairs:
        t.mul_(momentum).add_(s.detach(), alpha=1.0 - momentum)


@torch.no_grad()
def copy_student_to_teacher(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Start the teacher equal to the student."""
    for t, s in pairs:
        t.copy_(s)
