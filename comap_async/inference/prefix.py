"""Prompt-prefix KV cache: prompts that start alike skip recomputing their common start.

Every actor prompt of a role starts with the same chat-template header and system prompt (~60
tokens for SmolLM2), and prefill is compute-bound on CPU (~2 ms per token for SmolLM2 on one
core), so reusing those keys/values saves a large share of each request's prefill.

Blocks of ``block`` tokens are keyed by the adapter slot, the slot's *generation* (bumped whenever
the slot's weights change, so a recycled slot never reuses stale keys/values), and the whole token
prefix up to the block's end (a hash chain whose entries also keep their tokens, so a hash collision
can never return another prompt's values). Least recently used blocks are evicted beyond the budget.

A prompt computes from the end of its last cached full block, so a block's size is what a prompt
recomputes of a prefix it shares with an earlier one (half a block on average, every call): 8 tokens
rather than 32 saved 23 % of a co-evolution step's computed prompt tokens (:data:`PREFIX_CACHE_BLOCK`).
A block keeps every layer's keys (and values) in one tensor, so a lookup copies a block once per
tensor, not once per layer.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[str, int, int]  # (slot, generation, chained hash)
Block = tuple[torch.Tensor, torch.Tensor]  # every layer's keys and values: [layers, 1, heads, ..., ...]

PREFIX_CACHE_BLOCK = 8
"""Tokens per block. A prompt reuses whole blocks only, so it recomputes half a block of its known prefix on
average: with 8, a co-evolution step computed 23 % fewer prompt tokens than with 32 (the earlier size;
docs/inference.md), for a lookup that copies four times as many blocks."""


class PrefixCache:
    def __init__(self, block: int = PREFIX_CACHE_BLOCK, max_bytes: int = 256 << 20) -> None:
        self.block = block
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[Key, tuple[Key | None, tuple[int, ...], Block]] = OrderedDict()
        self._bytes = 0
        self.hits = 0  # tokens served from the cache (those computed: EngineStats.computed_by_adapter)
        self.evicted = 0  # blocks dropped for the budget: a budget below the live conversations' KV shows here

    def _chain(self, slot: str, gen: int, ids: list[int], upto: int):
        prev: Key | None = None
        for start in range(0, upto, self.block):
            toks = tuple(ids[start : start + self.block])
            key = (slot, gen, hash((prev, toks)))
            yield start, prev, toks, key
            prev = key

    def lookup(
        self, slot: str, gen: int, ids: list[int], key_dim: int = 2, capacity: int = 0
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(n cached tokens, per-layer (keys, values) ``[1, heads, capacity, dim]``); at least one token is left
        to compute.

        The tensors have ``max(n, capacity)`` positions, the first ``n`` the cached ones, the rest unwritten
        (room for the prompt's computed part: :class:`~comap_async.inference.kvcache.BufferLayer` reads only
        the positions written). ``key_dim``: the keys' position dimension (3 for a cache that keeps keys
        transposed).
        """
        usable = ((len(ids) - 1) // self.block) * self.block
        found: list[Block] = []
        for _, prev, toks, key in self._chain(slot, gen, ids, usable):
            entry = self._blocks.get(key)
            if entry is None or entry[0] != prev or entry[1] != toks:
                break
            self._blocks.move_to_end(key)
            found.append(entry[2])
        if not found:
            return 0, None
        n = len(found) * self.block
        positions = max(n, capacity)
        keys, values = _room(found[0][0], key_dim + 1, positions), _room(found[0][1], 3, positions)
        for i, (k, v) in enumerate(found):
            keys.narrow(key_dim + 1, i * self.block, self.block).copy_(k)
            values.narrow(3, i * self.block, self.block).copy_(v)
        return n, list(zip(keys.unbind(0), values.unbind(0)))

    def store(
        self,
        slot: str,
        gen: int,
        ids: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        key_dim: int = 2,
        offset: int = 0,
    ) -> None:
        """Keep the full blocks from ``start`` on of a freshly computed sequence (``layers``: its per-layer
        keys/values from position ``offset`` on)."""
        full = (len(ids) // self.block) * self.block
        for pos, prev, toks, key in self._chain(slot, gen, ids, full):
            if pos < start or key in self._blocks:
                continue
            at = pos - offset
            kv = (
                torch.stack([k.narrow(key_dim, at, self.block) for k, _ in layers]),
                torch.stack([v.narrow(2, at, self.block) for _, v in layers]),
            )
            self._blocks[key] = (prev, toks, kv)
            self._bytes += _nbytes(kv)
        while self._bytes > self.max_bytes and self._blocks:
            _, (_, _, kv) = self._blocks.popitem(last=False)
            self._bytes -= _nbytes(kv)
            self.evicted += 1

    @property
    def bytes(self) -> int:
        """Bytes of keys and values held (at most ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)


def _room(block: torch.Tensor, dim: int, positions: int) -> torch.Tensor:
    shape = list(block.shape)
    shape[dim] = positions
    return block.new_empty(shape)


def _nbytes(kv: Block) -> int:
    return sum(t.numel() * t.element_size() for t in kv)
