"""The embedded server's prefix-cache reuse rule without its tensors, for offline replays of a run's
prompts (benchmarks/prompt_reuse.py): tested to reuse exactly what ``comap_async/inference/prefix.py``'s
:class:`PrefixCache` reuses (tests/unit/test_prompt_reuse.py)."""

from __future__ import annotations


class BlockCache:
    """The prefix cache's reuse rule without its tensors (``comap_async/inference/prefix.py``'s chained full blocks)."""

    def __init__(self, block: int) -> None:
        self.block, self.keys = block, set()

    def computed(self, adapter: str, ids: list[int]) -> int:
        """Tokens ``ids`` computes: past its longest run of cached full blocks; then its full blocks are kept."""
        usable = ((len(ids) - 1) // self.block) * self.block
        prev, hit, chain = None, 0, []
        for start in range(0, len(ids) - len(ids) % self.block, self.block):
            key = (adapter, hash((prev, tuple(ids[start : start + self.block]))))
            chain.append(key)
            if start < usable and hit == start and key in self.keys:
                hit = start + self.block
            prev = key
        self.keys.update(chain)
        return len(ids) - hit
