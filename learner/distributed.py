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


def collective_device(backend: str, local_device: str | torch.device) -> torch.device:
    """The device a collective's tensors must be on: NCCL moves CUDA tensors only (this rank's card,
    ``local_device``), gloo CPU ones. A CPU tensor in an NCCL-only group fails at the collective
    ("No backend type associated with device type cpu"), so the choice is made in one place."""
    if backend == "nccl":
        device = torch.device(local_device)
        if device.type != "cuda":
            raise ValueError(f"the NCCL backend needs a CUDA device for its collectives, not {device}")
        return device
    return torch.device("cpu")


def check_collective(backend: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if ``backend`` can reduce it where it is; ValueError (naming the device) otherwise:
    a collective that NCCL would refuse fails here, where the gloo runs that test this code see it too."""
    if backend == "nccl" and tensor.device.type != "cuda":
        raise ValueError(f"an NCCL collective got a tensor on {tensor.device}: it needs the rank's CUDA device")
    return tensor


def rank_device(device: str, local_rank: int) -> str:
    """The learner's device with the rank's own card named: ``cuda`` under torchrun is ``cuda:{LOCAL_RANK}``.
    CUDA's current device is per thread and the step runs in a thread of its own (learner/step_thread.py),
    where a bare ``cuda`` would mean card 0 on every rank."""
    return f"cuda:{local_rank}" if device == "cuda" else device


@dataclass
class DataParallel:
    rank: int
    world: int
    backend: str = "gloo"
    device: str = "cpu"
    """This rank's learner device (``cuda:{LOCAL_RANK}`` on GPUs, :func:`rank_device`)."""

    @classmethod
    def from_env(cls, device: str) -> "DataParallel | None":
        """Join the process group torchrun describes (``WORLD_SIZE`` > 1); None for one process."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        import torch.distributed as dist

        device = rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), dist.get_backend(), device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def collective_device(self) -> torch.device:
        return collective_device(self.backend, self.device)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks, on ``tensor``'s device; the collective itself runs on
        :attr:`collective_device`. Every reduction of the learner goes through here."""
        import torch.distributed as dist

        moved = check_collective(self.backend, tensor.to(self.collective_device))
        dist.all_reduce(moved)
        return moved.to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank, on ``tensor``'s device (as :meth:`all_reduce`)."""
        import torch.distributed as dist

        moved = check_collective(self.backend, tensor.to(self.collective_device))
        dist.broadcast(moved, src=src)
        return moved.to(tensor.device)

    def sync_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Every rank starts from rank 0's weights."""
        with torch.no_grad():
            flat = self.broadcast(torch.cat([p.detach().reshape(-1) for p in params]), src=0)
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each gradient by its mean over the ranks (a rank that did not reach a parameter
        counts as 0 for it; a parameter no rank reached keeps no gradient, as in one process)."""
        grads = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device, dtype=p.dtype)
            for p in params
        ]
        reached = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        flat = self.all_reduce(torch.cat([*[g.float() for g in grads], reached]))
        offset = 0
        for i, p in enumerate(params):
            n = p.numel()
            if flat[-len(params) + i] > 0:
                p.grad = (flat[offset : offset + n] / self.world).view_as(p).to(p.dtype)
            offset += n

    def sum(self, values: list[int]) -> list[int]:
        return [int(v) for v in self.all_reduce(torch.tensor(values, dtype=torch.long))]

    def follow(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj]
        # pickled into a tensor on the group's device: named, not left to the calling thread's current CUDA device
        dist.broadcast_object_list(box, src=0, device=self.collective_device)
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
