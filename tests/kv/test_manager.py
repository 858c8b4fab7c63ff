"""Unit tests of the KV cache manager's rules (no torch)."""
from __future__ import annotations

import sys

import pytest

from pagedllm.demo import run_library_demo
from pagedllm.kv import KVCacheManager


def test_kv_package_needs_no_torch():
    import subprocess
    code = "import sys, pagedllm.kv, pagedllm.demo; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_slots_follow_the_block_table():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    kv.allocate_slots(0, list(range(3)), 3)
    kv.allocate_slots(1, list(range(6)), 6)
    kv.allocate_slots(0, list(range(6)), 6)
    t = kv.block_table(0)
    assert len(t.block_ids) == 2  # ceil(6 / 4)
    assert [t.slot(j) for j in range(6)] == [t.block_ids[j // 4] * 4 + j % 4 for j in range(6)]


def test_prefix_hit_never_covers_last_token():
    kv = KVCacheManager(16, 4)
    toks = list(range(8))
    kv.allocate_slots(0, toks, 8)
    assert len(kv.lookup_prefix(toks)) == 1          # 8 tokens: the last must be computed
    assert len(kv.lookup_prefix(toks + [99])) == 2
    assert kv.lookup_prefix([1] + toks[1:] + [99]) == []  # chained: a different first block


def test_salt_isolates_tenants():
    kv = KVCacheManager(16, 4)
    toks = list(range(9))
    kv.allocate_slots(0, toks, 9, hashes=kv.new_hashes("tenant-a"))
    assert len(kv.lookup_prefix(toks, kv.new_hashes("tenant-a"))) == 2
    assert kv.lookup_prefix(toks, kv.new_hashes("tenant-b")) == []
    assert kv.lookup_prefix(toks) == []


def test_cached_free_blocks_stay_hittable_and_evict_lru_tail_first():
    kv = KVCacheManager(4, 2)
    kv.allocate_slots(0, [1, 2, 3, 4, 5], 5)      # blocks: [1,2] [3,4] [5]
    kv.free(0)
    st = kv.stats()
    assert st.used_blocks == 0 and st.cached_free_blocks == 2
    hit = kv.lookup_prefix([1, 2, 3, 4, 9])
    assert len(hit) == 2                           # still hittable after free
    kv.allocate_slots(1, [7, 7], 2)                # takes a block: the never-cached ones go first
    assert len(kv.lookup_prefix([1, 2, 3, 4, 9])) == 2
    kv.allocate_slots(2, [8, 8, 8], 3)             # needs 2: evicts the tail block [3,4] first
    assert len(kv.lookup_prefix([1, 2, 3, 4, 9])) == 1
    assert kv.stats().evictions == 1


def test_prefix_hit_counts_tokens_and_revives_blocks():
    kv = KVCacheManager(8, 4)
    toks = list(range(10))
    kv.allocate_slots(0, toks, 10)
    kv.free(0)
    hit = kv.lookup_prefix(toks)
    kv.allocate_slots(1, toks, 10, hit)
    st = kv.stats()
    assert (st.prefix_queries, st.prefix_hits) == (20, 8)
    assert st.cached_free_blocks == 0 and st.used_blocks == 3
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(3, 4)
    kv.allocate_slots(0, list(range(8)), 8)
    before = (kv.pool.num_available, dict(kv.tables))
    assert kv.allocate_slots(1, list(range(9)), 9) is None
    assert (kv.pool.num_available, dict(kv.tables)) == before
    kv.check_integrity()


def test_copy_on_write_on_shared_partial_block():
    kv = KVCacheManager(8, 4)
    kv.allocate_slots(0, [1, 2, 3, 4, 5, 6], 6)
    kv.fork(0, 1)
    assert kv.block_table(1).block_ids == kv.block_table(0).block_ids
    copies = kv.allocate_slots(1, [1, 2, 3, 4, 5, 6, 7], 7)
    src = kv.block_table(0).block_ids[1]
    assert copies == [(src, kv.block_table(1).block_ids[1])]
    assert kv.pool.blocks[src].ref_cnt == 1
    assert kv.allocate_slots(0, [1, 2, 3, 4, 5, 6, 8], 7) == []  # now sole owner: in place
    assert kv.stats().cow_copies == 1


def test_reserve_max_fragments():
    kv = KVCacheManager(10, 4, policy="reserve-max", max_model_len=12)   # 3 blocks each
    for s in range(3):
        assert kv.allocate_slots(s, [1], 1) == []
    kv.free(1)                                      # hole of 3 at blocks 3..5, 1 free at 9
    assert kv.pool.num_available == 4
    assert kv.allocate_slots(3, [1], 1) == [] and kv.block_table(3).block_ids == [3, 4, 5]
    assert kv.allocate_slots(4, [1], 1) is None     # 1 block free, not 3 contiguous
    st = kv.stats()
    assert st.waste == pytest.approx(1 - 3 / 36)


def test_library_demo_numbers():
    r = run_library_demo(print_fn=lambda *a: None)
    assert (r["without_sharing"], r["with_sharing"]) == (11, 5)
    assert len(r["cow"]) == 1 and r["free_after"] == 12 and r["hit_blocks"] == 2
    assert r["refs"][:2] == [4, 4]


def test_slots_of_a_range_equal_slot_by_slot():
    """slots() builds runs per block; it must equal pid = table[j // B] * B + j % B per token."""
    import random

    from pagedllm.kv.block_table import BlockTable

    rng = random.Random(0)
    for b in (1, 3, 16):
        t = BlockTable(b, block_ids=rng.sample(range(1000), 50))
        for _ in range(100):
            lo = rng.randint(0, 50 * b)
            hi = rng.randint(lo, 50 * b)
            assert t.slots(lo, hi) == [t.block_ids[j // b] * b + j % b for j in range(lo, hi)]
