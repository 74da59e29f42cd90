"""``benchmarks/prompt_reuse.py`` counts what the server's prefix cache computes: its block model
(``experiments/prefix_model.py``) must reuse exactly what :class:`PrefixCache` reuses."""

from __future__ import annotations

import random

import torch

from comap_async.inference.prefix import PrefixCache
from experiments.prefix_model import BlockCache


def test_the_block_model_computes_what_the_prefix_cache_leaves_to_compute():
    rng = random.Random(0)
    base = [rng.randrange(50) for _ in range(150)]
    prompts = [base[:40], base[:100], base[:100] + [7] * 30, base[:31], base[:64], base, [1, 2, 3] + base, base[:150]]
    real, model = PrefixCache(block=16), BlockCache(16)
    for adapter in ("policy", "wm"):
        for ids in prompts:
            hit, _ = real.lookup(adapter, 0, ids)
            layer = torch.zeros(1, 1, len(ids), 1)
            real.store(adapter, 0, ids, [(layer, layer)], hit)
            assert model.computed(adapter, ids) == len(ids) - hit, (adapter, len(ids), hit)
