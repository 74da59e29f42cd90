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
_SHRINK = 8  # a leaving row's columns are given back once the buffers hold this many times the rest


def room_for(n: int) -> int:
    """Columns for new buffers holding ``n``: half as many again to grow into before a relayout."""
    return max(_MIN_CAPACITY, n + n // 2)


class BufferLayer(DynamicLayer):
    """One layer's keys/values in ``[rows, heads, capacity, head_dim]`` buffers: the first ``b`` rows
    are the batch, and their columns ``[off, off + n)`` are in use, with room on both sides.

    ``transposed``: keys are kept ``[rows, heads, head_dim, capacity]`` and ``keys`` is ``[b, ..., head_dim, n]``.
    """

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        self.kdim = 3 if transposed else 2
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.n = 0
        self.off = 0
        self.b = 0

    def _set(self, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int, off: int = 0, b: int | None = None) -> None:
        self.kbuf, self.vbuf, self.n, self.off = kbuf, vbuf, n, off
        self.b = kbuf.shape[0] if b is None else b
        self.keys, self.values = self._k(slice(0, self.b), off, n), self._v(slice(0, self.b), off, n)
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.is_initialized = True

    def _k(self, rows: slice | int, start: int, width: int) -> torch.Tensor:
        return self.kbuf[rows].narrow(self.kdim - (isinstance(rows, int)), start, width)

    def _v(self, rows: slice | int, start: int, width: int) -> torch.Tensor:
        return self.vbuf[rows].narrow(2 - (isinstance(rows, int)), start, width)

    @property
    def capacity(self) -> int:
        return 0 if self.vbuf is None else self.vbuf.shape[2]

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
        if self.off + self.n + add > self.capacity:
            self.relayout(self.kbuf.shape[0], max(self.off + self.n + add, 2 * self.capacity), left=self.off)
        self._k(slice(0, self.b), self.off + self.n, add).copy_(key_states)
        self._v(slice(0, self.b), self.off + self.n, add).copy_(value_states)
        self._set(self.kbuf, self.vbuf, self.n + add, self.off, self.b)
        return self.keys, self.values

    def relayout(self, rows: int, cap: int, left: int) -> None:
        """New buffers of ``rows`` rows and ``cap`` columns holding the batch's rows at columns
        ``[left, left + n)``: the one copy of the whole batch, when it has outgrown its room. The rest is
        left unwritten (a 4,000-column buffer of 8 rows is ~0.7 GB to zero): a column becomes visible
        only when written (:meth:`update`) or zeroed as padding (:meth:`append_rows`)."""
        _, h, _, d = self.vbuf.shape
        kb = self.kbuf.new_empty(*_shape(rows, h, cap, d, self.transposed))
        vb = self.vbuf.new_empty(rows, h, cap, d)
        kb[: self.b].narrow(self.kdim, left, self.n).copy_(self.keys)
        vb[: self.b, :, left : left + self.n] = self.values
        self._set(kb, vb, self.n, left, self.b)

    def keep_rows(self, order: list[int], trim: int) -> None:
        """Row ``order[i]`` becomes row ``i``, in place (each source row lies at or below every row
        written before it is read); the ``trim`` leftmost columns leave."""
        for dst, src in enumerate(order):
            if dst != src:
                self._k(dst, self.off, self.n).copy_(self._k(src, self.off, self.n))
                self._v(dst, self.off, self.n).copy_(self._v(src, self.off, self.n))
        self._set(self.kbuf, self.vbuf, self.n - trim, self.off + trim, len(order))
        if self.capacity > _SHRINK * max(self.n, _MIN_CAPACITY):  # longer rows have left: give the room back
            self.relayout(self.kbuf.shape[0], max(_MIN_CAPACITY, 2 * self.n), left=self.n // 2)

    def append_rows(self, other: "BufferLayer", total: int, rows_hint: int) -> None:
        """``other``'s rows below ours, every row right-aligned to ``total`` columns (the longer length):
        written into the spare rows and the room on the left when there are enough, else after one relayout."""
        k = other.b
        if self.b + k > self.kbuf.shape[0] or total - self.n > self.off:
            rows, cap = max(self.b + k, rows_hint), max(_MIN_CAPACITY, 2 * total)
            self.relayout(rows, cap, left=(cap - total) // 2 + total - self.n)
        off = self.off + self.n - total  # the right edge stays where it is
        if off < self.off:  # our rows' new left padding may hold what earlier, longer rows left there
            self._k(slice(0, self.b), off, self.off - off).zero_()
            self._v(slice(0, self.b), off, self.off - off).zero_()
        new = slice(self.b, self.b + k)
        pad = total - other.n
        self._k(new, off, pad).zero_()
        self._v(new, off, pad).zero_()
        self._k(new, off + pad, other.n).copy_(other.keys)
        self._v(new, off + pad, other.n).copy_(other.values)
        self._set(self.kbuf, self.vbuf, total, off, self.b + k)

    def get_seq_length(self) -> int:
        return self.n


class BatchCache(Cache):
    """The running batch's cache plus its attention mask (``[batch, n]``, 1 = real token).

    Rows join and leave in place: a joining row is written into a spare row of the buffers (its
    left padding into the room on the left when it is the longer), a leaving one's place is taken by
    the last row; the whole batch is copied only when it outgrows its buffers. Copying it at every join
    and leave cost 30-73 ms each at 8 rows of 300-1,600 tokens, 5-12 in place (``benchmarks/kv_join_leave.py``);
    live, ~4 % of co-evolution's steps (docs/inference.md)."""

    def __init__(self, num_layers: int, transposed: bool = False, rows_hint: int = 1) -> None:
        super().__init__(layers=[BufferLayer(transposed) for _ in range(num_layers)])
        self.transposed = transposed
        self.rows_hint = rows_hint  # the buffers' rows once they are reallocated (the engine's max batch)
        self.mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.layers[0].n if self.layers else 0

    @property
    def batch(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def select(self, keep: list[int]) -> list[int]:
        """Keep only the rows ``keep`` (ascending; finished sequences leave), then drop all-padding
        columns on the left. Returns the kept rows in their new order: the last rows move into the
        places of the ones that left, so a leaving row costs one row's copy at most."""
        if not keep:
            for layer in self.layers:
                layer.kbuf = layer.vbuf = None
                layer.keys = layer.values = None
                layer.n = layer.off = layer.b = 0
                layer.is_initialized = False
            self.mask = None
            return []
        order = self._order(keep)
        mask = self.mask[order]
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        for layer in self.layers:
            self._keep(layer, order, start)
        self.mask = mask[:, start:]
        return order

    @staticmethod
    def _order(keep: list[int]) -> list[int]:
        staying = set(keep)
        movers = iter([i for i in keep if i >= len(keep)])
        return [i if i in staying else next(movers) for i in range(len(keep))]

    def _keep(self, layer: BufferLayer, order: list[int], trim: int) -> None:
        layer.keep_rows(order, trim)

    def _join(self, mine: BufferLayer, theirs: BufferLayer, total: int) -> None:
        mine.append_rows(theirs, total, self.rows_hint)

    def merge(self, other: "BatchCache") -> None:
        """Append ``other``'s rows below ours, left-padding whichever is shorter."""
        if other.batch == 0:
            return
        if self.batch == 0:
            for mine, theirs in zip(self.layers, other.layers):
                mine._set(theirs.kbuf, theirs.vbuf, theirs.n, theirs.off, theirs.b)
            self.mask = other.mask
            return
        total = max(self.length, other.length)
        pad_a, pad_b = total - self.length, total - other.length
        for mine, theirs in zip(self.layers, other.layers):
            self._join(mine, theirs, total)
        ma = torch.nn.functional.pad(self.mask, (pad_a, 0))
        mb = torch.nn.functional.pad(other.mask, (pad_b, 0))
        self.mask = torch.cat([ma, mb], dim=0)

    def extend_mask(self, columns: int = 1) -> torch.Tensor:
        """The mask for the next decode (or verify) step: every row gains ``columns`` real columns."""
        self.mask = torch.nn.functional.pad(self.mask, (0, columns), value=1)
        return self.mask


def _shape(b: int, h: int, cap: int, d: int, transposed: bool) -> tuple[int, int, int, int]:
    return (b, h, d, cap) if transposed else (b, h, cap, d)
