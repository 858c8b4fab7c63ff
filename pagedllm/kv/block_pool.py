"""Physical KV blocks: ref counts, the LRU free queue and the prefix-cache map."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache. A freed block
    # keeps it, so it stays hittable until the pool hands it out again.
    block_hash: int | None = None


@dataclass(slots=True)
class PoolFigures:
    """The pool's own figures. A block is exactly one of used, cached-free and free."""
    num_blocks: int
    used_blocks: int          # ref > 0
    cached_free_blocks: int   # ref 0, still hittable by a prefix
    free_blocks: int          # ref 0, holding nothing
    shared_blocks: int        # ref > 1
    evictions: int            # cached-free blocks handed out again

    @property
    def usage(self) -> float:
        """U_kv: allocated blocks / all blocks."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0


class BlockPool:
    """All physical blocks. A block is exactly one of: used (ref > 0),
    cached-free (ref 0, hashed: reusable by a prefix hit until evicted), or free."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered oldest-first: the front is evicted first (LRU), in O(1).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_cached_free = 0
        self.num_shared = 0   # blocks with ref > 1, counted as refs change (no scan to report it)
        self.num_evictions = 0
        # (block id, the hash it held): set by the manager, which tells its listener and the tier
        self.on_evict: Callable[[int, int], None] | None = None
        # (the hash): a hash leaves the cache (evicted or reset); what is kept beside it goes too
        self.on_uncache: Callable[[int], None] | None = None

    # -- queries -------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free + cached-free, the whole free queue
        (KVStats.free_blocks counts the free ones only)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def is_available(self, block_id: int) -> bool:
        """In the free queue: free, or cached-free (a prefix hit may still revive it)."""
        return block_id in self.free_queue

    def figures(self) -> PoolFigures:
        return PoolFigures(self.num_blocks, self.num_used, self.num_cached_free,
                           len(self.free_queue) - self.num_cached_free, self.num_shared, self.num_evictions)

    # -- transitions ---------------------------------------------------------
    def allocate(self) -> int:
        """Hand out the least recently freed block, evicting its cache entry."""
        if not self.free_queue:
            raise NoFreeBlocksError("KV block pool exhausted")
        block_id, _ = self.free_queue.popitem(last=False)
        self._take(block_id)
        return block_id

    def allocate_run(self, length: int) -> list[int] | None:
        """First fit of `length` physically contiguous free blocks (reserve-max policy)."""
        run = 0
        for block_id in range(self.num_blocks):
            run = run + 1 if block_id in self.free_queue else 0
            if run == length:
                ids = list(range(block_id - length + 1, block_id + 1))
                for i in ids:
                    del self.free_queue[i]
                    self._take(i)
                return ids
        return None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_cnt == 0, f"block {block_id} in free queue with ref {block.ref_cnt}"
        if block.block_hash is not None:
            key = block.block_hash
            self._uncache(block)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block_id, key)
        block.ref_cnt = 1

    def touch(self, block_id: int) -> None:
        """Add a reference (prefix hit or fork); a cached-free block leaves the queue."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
            if block.block_hash is not None:
                self.num_cached_free -= 1
        block.ref_cnt += 1
        self.num_shared += block.ref_cnt == 2

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching
        ref 0 join the back of the queue (callers pass a request's blocks tail first,
        so its shared head is evicted last)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            self.num_shared -= block.ref_cnt == 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                if block.block_hash is not None:
                    self.num_cached_free += 1

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Register a full block under its hash; True if it now is. If another block
        already holds the same content, keep that one; this block stays ordinary."""
        if not self.enable_caching or block_hash in self.cached:
            return False
        block = self.blocks[block_id]
        assert block.block_hash is None and block.ref_cnt > 0
        block.block_hash = block_hash
        self.cached[block_hash] = block_id
        return True

    def tag(self, block_id: int, key: int) -> None:
        """Give a held block a key outside the prefix cache's (an adapter's page: kv.adapter_pages),
        with caching on or off: freed, it stays revivable under the key until handed out again."""
        block = self.blocks[block_id]
        assert block.block_hash is None and block.ref_cnt > 0 and key not in self.cached
        block.block_hash = key
        self.cached[key] = block_id

    def untag(self, block_id: int) -> None:
        """Drop a free block's key: it is plain free again."""
        block = self.blocks[block_id]
        assert block.ref_cnt == 0 and block.block_hash is not None
        self._uncache(block)

    def _uncache(self, block: Block) -> None:
        if self.on_uncache is not None:
            self.on_uncache(block.block_hash)
        del self.cached[block.block_hash]
        block.block_hash = None
        self.num_cached_free -= 1

    def reset_cache(self) -> int:
        """Forget every cached-free block (used ones keep their entries)."""
        dropped = 0
        for block_id in list(self.free_queue):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
                dropped += 1
        return dropped
