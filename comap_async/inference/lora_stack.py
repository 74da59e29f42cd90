"""Batched multi-adapter LoRA: one pair of ``bmm`` per layer, whatever the mix of adapters in the batch.

peft's mixed-batch forward loops over the adapters present in the batch and, per adapter and layer,
gathers its rows, runs A and B and scatters the result back: ~8 small ops per adapter per layer.
With SmolLM2's 210 LoRA layers and the 3-5 adapters a CoMap batch mixes (policy, world model,
teacher, old versions, base), that dispatch overhead halved decode throughput. Here every layer keeps
the A and B matrices of all slots stacked (row 0 = zeros = the base model); a step gathers each
row's matrices and applies them with two batched matmuls (the "BGMV" scheme of Punica/S-LoRA).

peft still creates, loads and owns the adapters; the stacks are a copy kept in sync when a slot's
weights change. Variants this path does not implement (DoRA, LoRA bias, embedding LoRA) switch the
manager back to peft's own mixed-batch forward.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class _LayerStack:
    def __init__(self, module: Any, capacity: int, rank: int) -> None:
        base = module.base_layer
        self.module = module
        self.a = torch.zeros(capacity, base.in_features, rank, dtype=base.weight.dtype)
        self.b = torch.zeros(capacity, rank, base.out_features, dtype=base.weight.dtype)

    def resize(self, capacity: int, rank: int) -> None:
        a = self.a.new_zeros(capacity, self.a.shape[1], rank)
        b = self.b.new_zeros(capacity, rank, self.b.shape[2])
        c, r = min(capacity, self.a.shape[0]), min(rank, self.a.shape[2])
        a[:c, :, :r] = self.a[:c, :, :r]
        b[:c, :r, :] = self.b[:c, :r, :]
        self.a, self.b = a, b


class LoraStacks:
    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.rank = 1
        self.rows: dict[str, int] = {}
        self._free = list(range(capacity - 1, 0, -1))  # row 0 stays zero: the base model
        self.layers: dict[int, _LayerStack] = {}
        self.lock = threading.Lock()
        self.step_rows: torch.Tensor | None = None
        self.by_base: dict[int, _LayerStack] = {}  # id of the wrapped base Linear -> its stack (the fused forward)
        # what copies of the stacks (the fused forward's dense matrices) check before reuse: ``layout``
        # changes with the layers, capacity or rank; a row's version with that row's weights, so a spare
        # built or filled beside the decoding does not invalidate the copies of the rows in use
        self.layout = 0
        self.row_version: dict[int, int] = {}

    # ------------------------------------------------------------ engine thread (structure)
    def attach(self, module: Any, fallback: Any, enabled: Any) -> None:
        """Route a peft ``lora.Linear`` through the stacks (``fallback`` = its own forward, used when disabled)."""
        with self.lock:
            stack = self.layers[id(module)] = self.by_base[id(module.base_layer)] = _LayerStack(
                module, self.capacity, self.rank
            )
            self.layout += 1

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not enabled():
                return fallback(x, *args, **kwargs)
            result = module.base_layer(x, *args, **kwargs)
            rows = self.step_rows
            if rows is None:  # every row is on the base model
                return result
            a = stack.a.index_select(0, rows)
            b = stack.b.index_select(0, rows)
            x3 = x if x.dim() == 3 else x.unsqueeze(1)
            delta = torch.bmm(torch.bmm(x3.to(a.dtype), a), b)
            return result + delta.view(result.shape).to(result.dtype)

        module.forward = forward

    def assign(self, slot: str) -> int:
        with self.lock:
            if not self._free:
                grown = self.capacity * 2
                self._free = list(range(grown - 1, self.capacity - 1, -1))
                self.capacity = grown
                for s in self.layers.values():
                    s.resize(self.capacity, self.rank)
                self.layout += 1
            row = self.rows[slot] = self._free.pop()
            self._touch(row)
            return row

    def release(self, slot: str) -> None:
        with self.lock:
            row = self.rows.pop(slot, None)
            if row is None:
                return
            for s in self.layers.values():
                s.a[row].zero_()
                s.b[row].zero_()
            self._free.append(row)
            self._touch(row)

    # ------------------------------------------------------------ any thread (weights of an unused slot)
    def sync(self, slot: str) -> None:
        """Copy the slot's current peft weights (times its scaling) into its stack rows."""
        with self.lock, torch.no_grad():
            row = self.rows[slot]
            need = max(
                (s.module.lora_A[slot].weight.shape[0] for s in self.layers.values() if slot in s.module.lora_A),
                default=1,
            )
            if need > self.rank:
                self.rank = need
                for s in self.layers.values():
                    s.resize(self.capacity, self.rank)
                self.layout += 1
            for s in self.layers.values():
                s.a[row].zero_()
                s.b[row].zero_()
                m = s.module
                if slot not in m.lora_A:
                    continue
                r = m.lora_A[slot].weight.shape[0]
                s.a[row, :, :r] = m.lora_A[slot].weight.t()
                s.b[row, :r, :] = m.lora_B[slot].weight.t() * m.scaling[slot]
            self._touch(row)

    def _touch(self, row: int) -> None:
        self.row_version[row] = self.row_version.get(row, 0) + 1

    def key(self, rows: list[int]) -> tuple:
        """Identifies the current weights of these rows (call with ``lock`` held)."""
        return (self.layout, self.rank, *((r, self.row_version.get(r, 0)) for r in rows))

    def rows_for(self, adapters: list[str], base: str) -> torch.Tensor | None:
        if all(a == base for a in adapters):
            return None
        return torch.tensor([0 if a == base else self.rows[a] for a in adapters], dtype=torch.long)
