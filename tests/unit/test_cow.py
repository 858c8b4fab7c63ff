"""KVCache.copy_blocks moves exactly the blocks asked, in every layer slot, K and V; and a
layout of several layer groups gives each layer its slot's tensors (no model loaded)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import get_backend
from pagedllm.config import EngineConfig
from pagedllm.kv import kv_layout
from pagedllm.runtime.kv_cache import KVCache

from .fakes import model_config


@pytest.mark.parametrize("windows", [(0, 0, 0), (0, 64, 64, 0)])
def test_copy_blocks_copies_exactly_the_pairs(windows):
    mc = model_config(windows)
    layout = kv_layout(windows)
    cache = KVCache(mc, EngineConfig(model="fake", num_gpu_blocks_override=8), torch.float32, torch.device("cpu"),
                    get_backend("torch"), layout=layout)
    assert cache.num_blocks == 8 and len(cache.pools) == layout.layers_per_block
    # Layer i of every group shares tensor slot i: groups (0, 3) and (1, 2) of the second layout.
    assert [id(cache.layers[i][0]) for i in range(len(windows))] == \
        [id(cache.pools[layout.place(i)[1]][0]) for i in range(len(windows))]
    g = torch.Generator().manual_seed(0)
    for k, v in cache.pools:
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    old = [(k.clone(), v.clone()) for k, v in cache.pools]
    for k, v in old:   # every block distinct from every other, so a wrong copy shows
        for t in (k, v):
            flat = t.reshape(t.shape[0], -1)
            assert torch.unique(flat, dim=0).shape[0] == t.shape[0]

    pairs = [(1, 6), (4, 0), (7, 3)]
    cache.copy_blocks(pairs)
    dsts = {d for _, d in pairs}
    for slot, ((k, v), (k0, v0)) in enumerate(zip(cache.pools, old)):
        for new, before, name in ((k, k0, "K"), (v, v0, "V")):
            for s, d in pairs:
                assert torch.equal(new[d], before[s]), f"slot {slot} {name}: block {d} != old block {s}"
            for b in range(cache.num_blocks):
                if b not in dsts:
                    assert torch.equal(new[b], before[b]), f"slot {slot} {name}: block {b} changed"

    cache.copy_blocks([])   # nothing to do: nothing changes
    for (k, v), (k0, v0) in zip(cache.pools, old):
        for s, d in pairs:
            assert torch.equal(k[d], k0[s]) and torch.equal(v[d], v0[s])
