"""A KV cache for continuous batching: rows join, leave and are left-padded to a common length.

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every decode step, which copies the whole
cache once per token per layer (quadratic in the sequence length, and the biggest non-matmul cost
at batch 8). ``BufferLayer`` writes into a preallocated buffer that doubles when full, so a decode
step only writes the new column. Rows are aligned on the right: a row that joined with a shorter
prompt has zero keys/values on its left, hidden from attention by the 2-D attention mask.

The fused forward keeps keys *transposed* (``[batch, heads, head_dim, capacity]``): its ``q @ K^T``
then reads a plain strided matrix, where a transposed view of a strided buffer makes the bf16
batched GEMM copy the whole cache first (2-3x slower attention at batch 8).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_CAPACITY = 64


class BufferLayer(DynamicLayer):
    """One layer's keys/values in ``[batch, heads, capacity, head_dim]`` buffers; ``n`` columns used.

    ``transposed``: keys are kept ``[batch, heads, head_dim, capacity]`` and ``keys`` is ``[..., head_dim, n]``.
    """

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        self.kdim = 3 if transposed else 2
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.n = 0

    def _set(self, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int) -> None:
        self.kbuf, self.vbuf, self.n = kbuf, vbuf, n
        self.keys, self.values = kbuf.narrow(self.kdim, 0, n), vbuf[:, :, :n]
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, heads, new, head_dim]`` keys and values; returns the layer's keys and values."""
        add = key_states.shape[-2]
        if self.transposed:
            key_states = key_states.transpose(-1, -2)
        if self.kbuf is None:
            b, h, _, d = value_states.shape
            cap = max(_MIN_CAPACITY, 2 * add)
            self._set(
                key_states.new_zeros(*_shape(b, h, cap, d, self.transposed)), value_states.new_zeros(b, h, cap, d), 0
            )
        need = self.n + add
        if need > self.kbuf.shape[self.kdim]:
            self._grow(max(need, 2 * self.kbuf.shape[self.kdim]))
        self.kbuf.narrow(self.kdim, self.n, add).copy_(key_states)
        self.vbuf[:, :, self.n : need] = value_states
        self._set(self.kbuf, self.vbuf, need)
        return self.keys, self.values

    def _grow(self, cap: int) -> None:
        self._set(*with_capacity(self.keys, self.values, self.n, self.transposed, cap), self.n)

    def get_seq_length(self) -> int:
        return self.n


class BatchCache(Cache):
    """The running batch's cache plus its attention mask (``[batch, n]``, 1 = real token)."""

    def __init__(self, num_layers: int, transposed: bool = False) -> None:
        super().__init__(layers=[BufferLayer(transposed) for _ in range(num_layers)])
        self.transposed = transposed
        self.mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.layers[0].n if self.layers else 0

    @property
    def batch(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def select(self, keep: list[int]) -> None:
        """Keep only these rows (finished sequences leave), then drop all-padding columns on the left."""
        if not keep:
            for layer in self.layers:
                layer.kbuf = layer.vbuf = None
                layer.keys = layer.values = None
                layer.n = 0
                layer.is_initialized = False
            self.mask = None
            return
        idx = torch.tensor(keep, dtype=torch.long)
        mask = self.mask.index_select(0, idx)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        for layer in self.layers:
            n = layer.n
            k = layer.kbuf.index_select(0, idx).narrow(layer.kdim, start, n - start)
            v = layer.vbuf.index_select(0, idx)[:, :, start:n]
            layer._set(*with_capacity(k, v, n - start, self.transposed), n - start)
        self.mask = mask[:, start:]

    def merge(self, other: "BatchCache") -> None:
        """Append ``other``'s rows below ours, left-padding whichever is shorter."""
        if other.batch == 0:
            return
        if self.batch == 0:
            for mine, theirs in zip(self.layers, other.layers):
                mine._set(theirs.kbuf, theirs.vbuf, theirs.n)
            self.mask = other.mask
            return
        total = max(self.length, other.length)
        pad_a, pad_b = total - self.length, total - other.length
        for mine, theirs in zip(self.layers, other.layers):
            ka, va, kb, vb = mine.keys, mine.values, theirs.keys, theirs.values
            b, h, _, d = va.shape
            cap = max(_MIN_CAPACITY, total + total // 2)
            k = ka.new_zeros(*_shape(b + kb.shape[0], h, cap, d, self.transposed))
            v = va.new_zeros(b + kb.shape[0], h, cap, d)
            k[:b].narrow(mine.kdim, pad_a, total - pad_a).copy_(ka)
            v[:b, :, pad_a:total] = va
            k[b:].narrow(mine.kdim, pad_b, total - pad_b).copy_(kb)
            v[b:, :, pad_b:total] = vb
            mine._set(k, v, total)
        ma = torch.nn.functional.pad(self.mask, (pad_a, 0))
        mb = torch.nn.functional.pad(other.mask, (pad_b, 0))
        self.mask = torch.cat([ma, mb], dim=0)

    def extend_mask(self, columns: int = 1) -> torch.Tensor:
        """The mask for the next decode (or verify) step: every row gains ``columns`` real columns."""
        self.mask = torch.nn.functional.pad(self.mask, (0, columns), value=1)
        return self.mask


def _shape(b: int, h: int, cap: int, d: int, transposed: bool) -> tuple[int, int, int, int]:
    return (b, h, d, cap) if transposed else (b, h, cap, d)


def with_capacity(
    k: torch.Tensor, v: torch.Tensor, n: int, transposed: bool = False, cap: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """New buffers with room to grow holding the first ``n`` positions of ``k`` and ``v``."""
    b, h, _, d = v.shape
    cap = cap or max(_MIN_CAPACITY, n + n // 2)
    kdim = 3 if transposed else 2
    kb, vb = k.new_zeros(*_shape(b, h, cap, d, transposed)), v.new_zeros(b, h, cap, d)
    kb.narrow(kdim, 0, n).copy_(k.narrow(kdim, 0, n))
    vb[:, :, :n] = v[:, :, :n]
    return kb, vb
