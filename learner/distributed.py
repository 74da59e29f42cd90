"""Data-parallel training with torch.distributed, started by ``torchrun`` (one process per GPU;
``gloo`` on CPU, ``nccl`` on CUDA).

Every rank holds the whole model with the same LoRA weights (broadcast from rank 0 at start),
samples its own micro-batches from the broker and computes its gradients; before each optimizer
step the gradients of the trained adapters are averaged over the ranks in one collective (a flat
buffer: the adapters are a few million numbers), so every rank takes the same step and the
weights stay equal. This is what DDP does for a model trained by one ``forward``; here one step
runs several forwards through two adapters (policy, world model) with gradient accumulation, so
the average is taken once, after the last of them. Rank 0 alone publishes, checkpoints, writes
scalars and announces; the phase schedule is rank 0's, broadcast (``DataParallel.follow``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DataParallel:
    rank: int
    world: int

    @classmethod
    def from_env(cls, device: str) -> "DataParallel | None":
        """Join the process group torchrun describes (``WORLD_SIZE`` > 1); None for one process."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        import torch.distributed as dist

        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def sync_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Every rank starts from rank 0's weights."""
        import torch.distributed as dist

        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=0)
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each gradient by its mean over the ranks (a rank that did not reach a parameter
        counts as 0 for it; a parameter no rank reached keeps no gradient, as in one process)."""
        import torch.distributed as dist

        grads = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device, dtype=p.dtype)
            for p in params
        ]
        reached = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        flat = torch.cat([*[g.float() for g in grads], reached])
        dist.all_reduce(flat)
        offset = 0
        for i, p in enumerate(params):
            n = p.numel()
            if flat[-len(params) + i] > 0:
                p.grad = (flat[offset : offset + n] / self.world).view_as(p).to(p.dtype)
            offset += n

    def sum(self, values: list[int]) -> list[int]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(t)
        return [int(v) for v in t]

    def follow(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
