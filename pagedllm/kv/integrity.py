"""The KV manager's invariants, checked between any two operations (tests, debug runs)."""
from __future__ import annotations

from .block_table import RELEASED


def check(kv) -> None:
    """(kv: a manager.KVCacheManager.) Ref counts equal table and connector references; used, cached-free and free partition
    the pool; the hash map points at the blocks that carry the hashes; every group holds the
    same sequences; kept prompt logprobs live only beside cached blocks, within their cap."""
    pool = kv.pool
    refs = [0] * pool.num_blocks
    for b, n in (kv.connector.pins.items() if kv.connector is not None else ()):
        assert n > 0, f"block {b}: {n} pins"
        refs[b] += n
    kv.adapters.count_refs(refs)
    for g in kv.groups:
        g.count_refs(refs)
        assert g.tables.keys() == kv.tables.keys(), f"group {g.gid} holds other sequences than group 0"
    cached_free = 0
    for blk in pool.blocks:
        assert blk.ref_cnt == refs[blk.block_id], f"block {blk.block_id}: ref {blk.ref_cnt} != {refs[blk.block_id]} holders"
        available = pool.is_available(blk.block_id)
        assert available == (blk.ref_cnt == 0), f"block {blk.block_id} free-queue mismatch"
        if blk.block_hash is not None:
            assert pool.cached[blk.block_hash] == blk.block_id
            cached_free += available
    assert cached_free == pool.num_cached_free
    assert pool.num_shared == sum(r > 1 for r in refs), "shared-block count drifted"
    assert len(pool.cached) == sum(b.block_hash is not None for b in pool.blocks)
    assert RELEASED not in pool.cached.values()
    ad = kv.adapters
    assert ad.pages.keys() == ad.users.keys() | ad.idle.keys() and not ad.users.keys() & ad.idle.keys()
    for a, blocks in ad.pages.items():
        for i, b in enumerate(blocks):
            assert pool.blocks[b].block_hash == ad._tag(a, i), f"adapter {a} page {i} (block {b}) lost its tag"
            assert pool.is_available(b) == (a in ad.idle), f"adapter {a}: block {b} held wrongly"
    assert sum(k < 0 for k in pool.cached) == sum(map(len, ad.pages.values())), "a tag outlived its adapter"
    assert kv.scores.entries.keys() <= pool.cached.keys(), "a kept entry outlived its block"
    assert kv.scores.bytes <= kv.scores.cap_bytes, "kept entries over their cap"
