"""LoRA adapters as pages of the KV pool (kv.adapter_pages): placed on first use, held while
used, idle and revivable after, evicted in the pool's LRU order when KV needs the blocks."""
from pagedllm.kv import KVCacheManager


def test_an_idle_adapter_is_revived_for_free_and_evicted_when_kv_needs_its_pages() -> None:
    kv = KVCacheManager(8, 4)
    ad = kv.adapters
    assert ad.acquire(7, 3) and ad.take_loads() == [(7, ad.pages[7])]
    assert kv.pool.num_available == 5 and ad.cost(7, 3) == 0
    ad.release(7)
    assert kv.pool.num_available == 8 and ad.figures().idle_pages == 3 and ad.cost(7, 3) == 3
    assert ad.acquire(7, 3) and ad.take_loads() == [] and ad.num_loads == 1   # revived: nothing to write
    ad.release(7)
    # KV takes the never-used blocks first, then the idle adapter's: it leaves the pool whole.
    assert kv.allocate_slots(0, list(range(20)), 20) is not None   # 5 blocks
    assert 7 in ad.pages
    assert kv.allocate_slots(1, list(range(4)), 4) is not None
    assert 7 not in ad.pages and ad.num_evictions == 1
    assert all(b.block_hash is None or b.block_hash >= 0 for b in kv.pool.blocks)
    kv.check_integrity()
    kv.free(1)
    assert ad.acquire(7, 3) and len(ad.take_loads()) == 1 and ad.num_loads == 2   # placed again
    kv.check_integrity()


def test_a_held_adapter_is_never_evicted_and_waits_for_room() -> None:
    kv = KVCacheManager(6, 4)
    ad = kv.adapters
    assert ad.acquire(1, 4)
    assert kv.allocate_slots(0, list(range(12)), 12) is None   # 3 blocks: only 2 are left
    assert not ad.acquire(2, 3) and 2 not in ad.pages          # no room: nothing changed
    assert ad.acquire(1, 4) and ad.users[1] == 2
    kv.reset_prefix_cache()   # a held adapter keeps its tags through a cache reset
    kv.check_integrity()
    ad.release(1)
    ad.release(1)
    kv.reset_prefix_cache()   # an idle one does not
    assert not ad.pages and kv.pool.num_available == 6
    kv.check_integrity()
