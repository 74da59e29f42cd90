"""Prompt-prefix KV cache: prompts that start alike skip recomputing their common start.

Every actor prompt of a role starts with the same chat-template header and system prompt (~60
tokens for SmolLM2), and prefill is compute-bound on CPU (~2 ms per token for SmolLM2 on one
core), so reusing those keys/values saves a large share of each request's prefill.

Blocks of ``block`` tokens are keyed by the adapter slot, the slot's *generation* (bumped whenever
the slot's weights change, so a recycled slot never reuses stale keys/values), and the whole token
prefix up to the block's end (a hash chain whose entries also keep their tokens, so a hash collision
can never return another prompt's values). Least recently used blocks are evicted beyond the budget.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[str, int, int]  # (slot, generation, chained hash)


class PrefixCache:
    def __init__(self, block: int = 32, max_bytes: int = 256 << 20) -> None:
        self.block = block
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[Key, tuple[Key | None, tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]] = (
            OrderedDict()
        )
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
        self, slot: str, gen: int, ids: list[int], key_dim: int = 2
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(n cached tokens, per-layer (keys, values) ``[1, heads, n, dim]``); at least one token is left to compute.

        ``key_dim``: the keys' position dimension (3 for a cache that keeps keys transposed).
        """
        usable = ((len(ids) - 1) // self.block) * self.block
        found: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for _, prev, toks, key in self._chain(slot, gen, ids, usable):
            entry = self._blocks.get(key)
            if entry is None or entry[0] != prev or entry[1] != toks:
                break
            self._blocks.move_to_end(key)
            found.append(entry[2])
        if not found:
            return 0, None
        layers = [
            (torch.cat([b[i][0] for b in found], dim=key_dim), torch.cat([b[i][1] for b in found], dim=2))
            for i in range(len(found[0]))
        ]
        return len(found) * self.block, layers

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
            kv = [(k.narrow(key_dim, at, self.block).clone(), v[:, :, at : at + self.block].clone()) for k, v in layers]
            self._blocks[key] = (prev, toks, kv)
            self._bytes += sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        while self._bytes > self.max_bytes and self._blocks:
            _, (_, _, kv) = self._blocks.popitem(last=False)
            self._bytes -= sum(k.numel() * k.element_size() * 2 for k, _ in kv)
            self.evicted += 1

    @property
    def bytes(self) -> int:
        """Bytes of keys and values held (at most ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)
