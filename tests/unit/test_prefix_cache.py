"""The prefix cache's blocks give back exactly the keys and values stored, at their positions, for both
key layouts, with room for the prompt's computed part; the budget evicts the least recently used."""

from __future__ import annotations

import pytest
import torch

from comap_async.inference.prefix import PrefixCache

LAYERS, HEADS, DIM = 3, 2, 4


def computed_kv(n: int, key_dim: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer keys and values of an ``n``-token sequence, every position distinct."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        k = torch.randn(1, HEADS, n, DIM, generator=g)
        out.append((k.transpose(2, 3).contiguous() if key_dim == 3 else k, torch.randn(1, HEADS, n, DIM, generator=g)))
    return out


@pytest.mark.parametrize("key_dim", [2, 3])
@pytest.mark.parametrize("block", [1, 4, 8])
def test_lookup_returns_the_stored_positions_with_room_after_them(key_dim, block):
    ids = list(range(100, 137))
    kv = computed_kv(len(ids), key_dim, 0)
    cache = PrefixCache(block=block, max_bytes=1 << 30)
    cache.store("policy", 0, ids, kv, 0, key_dim)
    longer = ids + [7, 8, 9]
    n, layers = cache.lookup("policy", 0, longer, key_dim, capacity=60)
    assert n == len(ids) // block * block and len(layers) == LAYERS
    for (k, v), (k_ref, v_ref) in zip(layers, kv):
        assert k.shape[key_dim] == 60 and v.shape[2] == 60 and k.is_contiguous() and v.is_contiguous()
        assert torch.equal(k.narrow(key_dim, 0, n), k_ref.narrow(key_dim, 0, n))
        assert torch.equal(v[:, :, :n], v_ref[:, :, :n])
    # at least one token is left to compute, and another adapter, generation or prefix finds nothing
    assert cache.lookup("policy", 0, ids[: 2 * block], key_dim)[0] == block
    assert cache.lookup("wm", 0, longer, key_dim) == (0, None)
    assert cache.lookup("policy", 1, longer, key_dim) == (0, None)
    assert cache.lookup("policy", 0, [1] + longer, key_dim) == (0, None)


def test_a_later_store_extends_a_chain_from_its_offset():
    """``_store_outputs`` hands over a reply's keys and values from ``offset`` on: the chain continues."""
    ids = list(range(40))
    kv = computed_kv(40, 2, 1)
    cache = PrefixCache(block=8, max_bytes=1 << 30)
    cache.store("p", 0, ids[:20], [(k[:, :, :20], v[:, :, :20]) for k, v in kv], 0)
    assert cache.lookup("p", 0, ids)[0] == 16
    cache.store("p", 0, ids, [(k[:, :, 16:], v[:, :, 16:]) for k, v in kv], 16, offset=16)
    n, layers = cache.lookup("p", 0, ids + [0])
    assert n == 40
    assert all(torch.equal(k, kr) and torch.equal(v, vr) for (k, v), (kr, vr) in zip(layers, kv))


def test_the_budget_evicts_the_least_recently_used_blocks():
    one_block = 2 * LAYERS * HEADS * 4 * DIM * 4  # keys and values of 4 fp32 positions in every layer
    cache = PrefixCache(block=4, max_bytes=4 * one_block)
    a, b, c = list(range(8)), list(range(50, 58)), list(range(80, 88))
    cache.store("p", 0, a, computed_kv(8, 2, 2), 0)
    cache.store("p", 0, b, computed_kv(8, 2, 3), 0)
    assert cache.bytes == 4 * one_block and len(cache) == 4 and cache.evicted == 0
    cache.lookup("p", 0, a + [0])  # a's blocks are now the most recently used
    cache.store("p", 0, c, computed_kv(8, 2, 4), 0)
    assert cache.bytes == 4 * one_block and cache.evicted == 2
    assert [cache.lookup("p", 0, ids + [0])[0] for ids in (a, b, c)] == [8, 0, 8]
