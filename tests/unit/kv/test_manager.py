"""Unit tests of the KV cache manager's rules (no torch)."""
from __future__ import annotations


import pytest

from pagedllm.demo import run_library_demo
from pagedllm.kv import KVCacheManager
from pagedllm.kv.block_table import RELEASED
from pagedllm.kv.groups import KV, STATE, STATE_WINDOW


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
    assert kv.stats().pool.evictions == 1


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


# -- sliding window ------------------------------------------------------------
def _windowed(num_blocks: int = 16, window: int = 6, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, sliding_window=window, **kw)


def test_window_releases_blocks_no_later_query_reads():
    """Window 6, blocks of 4: the query at p reads keys p-5..p, so once the first query of a
    step is at 9, block 0 (keys 0..3) is released; its entry becomes -1, the numbering stays."""
    from pagedllm.kv.block_table import RELEASED

    kv = _windowed()
    toks = list(range(12))
    kv.allocate_slots(0, toks, 8)
    t = kv.block_table(0)
    kv.allocate_slots(0, toks, 9)                     # the query at 8 reads keys 3..8
    assert t.num_released == 0
    kv.allocate_slots(0, toks, 10)                    # the query at 9 reads keys 4..9
    assert t.block_ids[0] == RELEASED and t.num_released == 1
    assert t.slots(9, 10) == [t.block_ids[2] * 4 + 1]  # pid = table[j // B] still
    with pytest.raises(IndexError, match="sliding window"):
        t.slot(2)
    st = kv.stats()
    assert st.window_released == 1 and st.used_blocks == 2 and st.cached_free_blocks == 1  # it keeps its hash
    assert st.blocks_without_sharing == 2
    kv.check_integrity()
    kv.free(0)
    assert kv.pool.num_available == 16 and kv.stats().window_released == 1


def test_window_releases_relative_to_the_first_query_of_the_step():
    """A chunk of queries [s, e) reads keys from s - W + 1: a step releases relative to its
    first query (also before it grows: the released blocks serve its growth), and a query
    re-run after a rollback still finds its keys."""
    kv = _windowed(num_blocks=6)
    toks = list(range(40))
    kv.allocate_slots(0, toks, 16)
    assert kv.allocate_slots(0, toks, 28, first_query=12) == []   # keys from 7: block 0 goes, 3 come
    t = kv.block_table(0)
    assert t.num_released == 1 and len(t.held) == 6 == kv.pool.num_used
    kv.allocate_slots(0, toks, 29, first_query=28)                # keys from 23: blocks 0..4 gone
    assert t.num_released == 5
    with pytest.raises(ValueError, match="first_query"):
        kv.allocate_slots(0, toks, 30, first_query=30)            # past the tokens already held
    with pytest.raises(ValueError, match="sliding window"):
        kv.rollback(0, 20, toks)                                  # its next query would read keys 15..20
    assert len(kv.rollback(0, 28, toks)) == 1                     # the draft at 28 rejected: fine


def test_fork_refuses_a_child_whose_window_was_released():
    kv = _windowed()
    toks = list(range(20))
    kv.allocate_slots(0, toks, 19)
    kv.allocate_slots(0, toks, 20)                                # the query at 19: blocks 0..2 released
    t = kv.block_table(0)
    assert t.num_released == 3
    with pytest.raises(ValueError, match="fork at 12"):
        kv.fork(0, 1, 12)                                         # its query at 12 reads keys 7..12
    assert kv.fork(0, 1, 17) == []                                # reads 12..17: held
    child = kv.block_table(1)
    assert child.block_ids[:3] == t.block_ids[:3] and child.num_released == 3
    assert kv.stats().pool.shared_blocks == 2
    kv.check_integrity()


def test_window_hit_needs_only_the_blocks_its_queries_read():
    """A cached prefix whose first blocks were evicted is still a hit where the window makes
    it exact: the new sequence's queries (from the hit's end on) read none of them."""
    from pagedllm.kv.block_table import RELEASED

    kv = _windowed(num_blocks=8)
    toks = list(range(100, 124))                                  # 6 blocks
    for n in range(1, 25):                                        # decoded one by one: blocks 0..3 released
        kv.allocate_slots(0, toks, n)
    kv.free(0)                                                    # the free queue: 6, 7, then 0..3, then 5, 4
    kv.allocate_slots(1, list(range(16)), 16)                     # takes 6, 7 and evicts 0, 1
    query = toks + [7]
    hit = kv.lookup_prefix(query)
    assert hit[:2] == [RELEASED, RELEASED] and RELEASED not in hit[2:] and len(hit) == 6
    kv.allocate_slots(2, query, 25, hit)                          # its query at 24 reads keys 19..24
    t = kv.block_table(2)
    assert t.num_released == 4 and t.held[:2] == hit[4:]          # blocks 2, 3 are not even taken
    assert kv.stats().prefix_hits == 24
    kv.check_integrity()


def test_window_hit_rule():
    """A hit of k blocks needs blocks (k*B - W + 1) // B .. k - 1 (vLLM's SlidingWindowManager
    rule); missing one of those, the hit is shorter or none, never wrong. Without a window
    a hit is a run of leading blocks."""
    R = -1
    kv = _windowed(window=6)                                      # B = 4
    assert kv.shorten_hit([R, R, 2, 3, R, 5], 6) == [R, R, 2, 3]  # 24 needs 4, 5; 20 needs 3, 4; 16 needs 2, 3
    assert kv.shorten_hit([R, R, 2, 3, 4, 5], 6) == [R, R, 2, 3, 4, 5]
    assert kv.shorten_hit([R, R, 2, 3, 4, 5], 3) == []            # 12 needs 1, 2; 8 needs 0, 1; 4 needs 0
    assert kv.shorten_hit([0, R, 2, R], 4) == [0]                # 12 needs 1, 2; 8 needs 0, 1
    assert kv.shorten_hit([0, R, 2, 3], 4) == [0, R, 2, 3]        # 16 needs 2, 3
    assert _windowed(window=1).shorten_hit([R, R, R, 3], 4) == [R, R, R, 3]  # a window of 1 reads only itself
    assert KVCacheManager(16, 4).shorten_hit([0, 1, R, 3], 4) == [0, 1]
    assert KVCacheManager(16, 4).shorten_hit([0, 1, 2, 3], 3) == [0, 1, 2]


def test_window_bounds_what_can_ever_fit():
    """Under a window a sequence holds its window's blocks, not its length's: a request
    longer than the pool fits."""
    kv = _windowed(num_blocks=8, window=16, max_step_tokens=8)
    assert kv.shape.window_blocks == (7,) and kv.can_ever_fit(1000)
    assert not KVCacheManager(8, 4).can_ever_fit(1000)
    assert KVCacheManager(8, 4, policy="reserve-max", max_model_len=32, sliding_window=16).groups[0].window == 0


def test_a_state_group_forks_only_where_a_state_is_kept_and_never_rolls_back():
    """A recurrent state lives at block ends and at the last token: a fork elsewhere, or a
    rollback of a step already run through it, is refused before any group changes."""
    kv = KVCacheManager(16, 4, group_windows=(0, STATE_WINDOW), group_kinds=(KV, STATE))
    toks = list(range(11))
    assert kv.allocate_slots(0, toks, 10) == []
    assert RELEASED not in kv.block_table(0, 1).block_ids, "a prefill step writes a snapshot into each block"
    assert kv.allocate_slots(0, toks, 11) == []
    assert kv.block_table(0, 1).block_ids[:2] == [RELEASED, RELEASED], \
        "the next step keeps only the block its query reads"
    assert kv.pool.num_cached_free == 2, "the released snapshots stay in the prefix cache"
    for n in (6, 8):   # mid-block; a block end whose snapshot the step released
        with pytest.raises(ValueError, match="recurrent state is kept at the last token"):
            kv.fork(0, 1, n)
    assert 1 not in kv.tables
    assert kv.fork(0, 1) == [] and kv.block_table(1, 1).held == kv.block_table(0, 1).held
    held = kv.pool.num_used
    with pytest.raises(ValueError, match="cannot be rolled back"):
        kv.rollback(0, 9, toks)
    assert kv.pool.num_used == held and kv.block_table(0).num_tokens == 11
    assert [g.kind for g in kv.stats().groups] == ["full", "state"]
    with pytest.raises(ValueError, match="group_kinds"):
        KVCacheManager(16, 4, group_windows=(0, STATE_WINDOW), group_kinds=(KV, "latent"))


def test_a_state_snapshot_is_hit_only_once_its_step_has_run():
    """A state block registered while a step is scheduled is written by that step's forward, after
    any read in it: a prompt admitted in the same step does not hit it; in the next step it does."""
    kv = KVCacheManager(32, 4, group_windows=(0, STATE_WINDOW), group_kinds=(KV, STATE))
    kv.begin_step()
    stem = list(range(9))
    assert kv.allocate_slots(0, stem, 9) == []
    assert len(kv.lookup_prefix(stem + [20])) == 0, "its blocks' state is not computed before the forward"
    kv.begin_step()
    hit = kv.lookup_prefix(stem + [20])
    assert len(hit) == 2 and hit.per_group[1][-1] == kv.block_table(0, 1).block_ids[1]
