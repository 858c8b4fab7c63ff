"""The KV cache manager: who holds which physical block. Plain Python, no torch.

It speaks in block ids and slot numbers only. Copy-on-write and fork decisions are
made here and returned as (src, dst) block pairs for the model runner to copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .block_pool import BlockPool
from .block_table import BlockTable
from .hashing import hash_block

POLICIES = ("paged", "reserve-max")


@dataclass(slots=True)
class KVStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    cached_free_blocks: int
    free_blocks: int
    usage: float              # U_kv: allocated blocks / all blocks
    used_slots: int           # slots that hold a token (a shared block counts once)
    waste: float              # eta: (allocated - used) / allocated slots
    blocks_without_sharing: int
    prefix_queries: int       # tokens looked up in the prefix cache
    prefix_hits: int          # tokens served from it
    cow_copies: int
    forks: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 policy: str = "paged", max_model_len: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if policy not in POLICIES:
            raise ValueError(f"allocation policy must be one of {POLICIES}, got {policy!r}")
        if policy == "reserve-max":
            if max_model_len is None:
                raise ValueError("reserve-max needs max_model_len")
            # The traditional scheme has no block sharing, hence no prefix cache.
            enable_prefix_caching = False
        self.block_size = block_size
        self.policy = policy
        self.enable_prefix_caching = enable_prefix_caching
        self.reserve_blocks = -(-max_model_len // block_size) if max_model_len else 0
        if policy == "reserve-max" and self.reserve_blocks > num_blocks:
            raise ValueError(f"reserve-max needs {self.reserve_blocks} blocks per sequence "
                             f"(max_model_len {max_model_len}) but the pool has {num_blocks}")
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tables: dict[int, BlockTable] = {}
        # Receives every block-level change as a small dict (see pagedllm.viz.state for
        # their meaning). None when nobody watches: then emitting costs one test.
        self.listener: Callable[[dict], None] | None = None
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.cow_copies = 0
        self.forks = 0

    def watch(self, listener: Callable[[dict], None] | None) -> None:
        """Send every block-level change to `listener` (None: stop)."""
        self.listener = listener
        self.pool.on_evict = None if listener is None else (lambda b: listener({"type": "evict", "block": b}))

    # -- prefix cache --------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """Blocks of the longest cached full-block prefix. It never covers the last
        token: that one must be computed to produce logits."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        B = self.block_size
        for i in range((len(token_ids) - 1) // B):
            parent = hash_block(parent, token_ids[i * B:(i + 1) * B], salt)
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                       cached_blocks: Sequence[int] = (), salt: str | None = None
                       ) -> list[tuple[int, int]] | None:
        """Give sequence `seq_id` slots for its first `num_tokens` tokens.

        A sequence not yet known starts from `cached_blocks` (a prefix hit). Returns the
        copy-on-write pairs the runner must copy before writing, or None if the pool
        cannot fit it now, in which case nothing has changed.
        """
        table = self.tables.get(seq_id)
        new = table is None
        if new:
            table = BlockTable(self.block_size, salt=salt)
        start = len(cached_blocks) * self.block_size if new else table.num_tokens
        if num_tokens < start:
            raise ValueError(f"num_tokens {num_tokens} < tokens already held {start}")

        B = self.block_size
        have = len(cached_blocks) if new else len(table.block_ids)
        if self.policy == "reserve-max":
            need_new = self.reserve_blocks if new else 0
        else:
            need_new = max(0, -(-num_tokens // B) - have)
        # A block is written in place only if this sequence alone holds it and it is not
        # in the prefix cache (a cached block's content is registered under its hash).
        cow = False
        if not new and start % B != 0 and start < num_tokens:
            blk = self.pool.blocks[table.block_ids[start // B]]
            cow = blk.ref_cnt > 1 or blk.block_hash is not None
        # Cached-free hits leave the free queue when touched, so they cost capacity too.
        revived = sum(1 for b in cached_blocks if self.pool.is_free(b)) if new else 0
        if need_new + cow + revived > self.pool.num_free:
            return None

        copies: list[tuple[int, int]] = []
        if new:
            if self.policy == "reserve-max":
                run = self.pool.allocate_run(self.reserve_blocks)
                if run is None:  # enough free blocks, but not contiguous: external fragmentation
                    return None
                table.block_ids = run
                if self.listener is not None:
                    self.listener({"type": "alloc", "seq": seq_id, "blocks": list(run)})
            else:
                for b in cached_blocks:
                    self.pool.touch(b)
                table.block_ids = list(cached_blocks)
                if self.enable_prefix_caching:
                    self.prefix_queries += len(token_ids)
                    self.prefix_hits += start
                if self.listener is not None:
                    self.listener({"type": "hit", "seq": seq_id, "blocks": list(cached_blocks),
                                   "tokens": start, "queried": len(token_ids)})
            table.num_tokens = start
            self.tables[seq_id] = table
        elif cow:
            i = start // B
            src = table.block_ids[i]
            dst = self.pool.allocate()
            self.pool.release([src])
            table.block_ids[i] = dst
            copies.append((src, dst))
            self.cow_copies += 1
            if self.listener is not None:
                self.listener({"type": "cow", "seq": seq_id, "index": i, "src": src, "dst": dst})
        if self.policy == "paged" and need_new:
            fresh = [self.pool.allocate() for _ in range(need_new)]
            table.block_ids.extend(fresh)
            if self.listener is not None:
                self.listener({"type": "alloc", "seq": seq_id, "blocks": fresh})
        table.num_tokens = num_tokens
        if self.listener is not None:
            self.listener({"type": "fill", "seq": seq_id, "tokens": num_tokens})
        self._cache_full_blocks(table, token_ids)
        return copies

    def _cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        if not self.enable_prefix_caching:
            return
        B = self.block_size
        for i in range(len(table.block_hashes), table.num_tokens // B):
            parent = table.block_hashes[-1] if table.block_hashes else None
            h = hash_block(parent, token_ids[i * B:(i + 1) * B], table.salt)
            table.block_hashes.append(h)
            if self.pool.cache(table.block_ids[i], h) and self.listener is not None:
                self.listener({"type": "cache", "block": table.block_ids[i]})

    def fork(self, parent_id: int, child_id: int, num_tokens: int | None = None
             ) -> list[tuple[int, int]] | None:
        """Child shares the parent's blocks for its first `num_tokens` tokens (default
        all), each ref +1. Under reserve-max the child gets its own reservation and the
        filled blocks are copied (returned as pairs). None if it does not fit."""
        parent = self.tables[parent_id]
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        n = parent.num_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= parent.num_tokens:
            raise ValueError(f"fork length {n} outside [0, {parent.num_tokens}]")
        B = self.block_size
        k = -(-n // B)
        child = BlockTable(B, num_tokens=n, salt=parent.salt,
                           block_hashes=parent.block_hashes[:n // B])
        copies: list[tuple[int, int]] = []
        if self.policy == "reserve-max":
            run = self.pool.allocate_run(self.reserve_blocks)
            if run is None:
                return None
            child.block_ids = run
            copies = list(zip(parent.block_ids[:k], run[:k]))
        else:
            child.block_ids = parent.block_ids[:k]
            for b in child.block_ids:
                self.pool.touch(b)
        self.tables[child_id] = child
        self.forks += 1
        if self.listener is not None:
            self.listener({"type": "fork", "parent": parent_id, "seq": child_id, "blocks": list(child.block_ids),
                           "tokens": n, "shared": self.policy == "paged"})
        return copies

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks, tail first (its tail is the least likely reused)."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            tail_first = table.block_ids[::-1]
            self.pool.release(tail_first)
            if self.listener is not None:
                self.listener({"type": "free", "seq": seq_id, "blocks": tail_first})

    # -- queries -------------------------------------------------------------
    def block_table(self, seq_id: int) -> BlockTable:
        return self.tables[seq_id]

    def can_ever_fit(self, num_tokens: int) -> bool:
        need = self.reserve_blocks if self.policy == "reserve-max" else -(-num_tokens // self.block_size)
        return need <= self.pool.num_blocks

    def reset_prefix_cache(self) -> int:
        dropped = self.pool.reset_cache()
        if self.listener is not None:
            self.listener({"type": "reset_cache"})
        return dropped

    def stats(self) -> KVStats:
        B = self.block_size
        fill: dict[int, int] = {}
        without_sharing = 0
        for t in self.tables.values():
            without_sharing += t.num_used_blocks
            for i, b in enumerate(t.block_ids):
                f = min(B, max(0, t.num_tokens - i * B))
                if f > fill.get(b, -1):
                    fill[b] = f
        used = self.pool.num_used
        used_slots = sum(fill.values())
        alloc_slots = used * B
        return KVStats(
            num_blocks=self.pool.num_blocks, block_size=B, used_blocks=used,
            cached_free_blocks=self.pool.num_cached_free,
            free_blocks=self.pool.num_free - self.pool.num_cached_free,
            usage=used / self.pool.num_blocks, used_slots=used_slots,
            waste=(alloc_slots - used_slots) / alloc_slots if alloc_slots else 0.0,
            blocks_without_sharing=without_sharing,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
            cow_copies=self.cow_copies, forks=self.forks, evictions=self.pool.num_evictions)

    def check_integrity(self) -> None:
        """Invariants that must hold between any two operations (used by tests and
        debug runs): ref counts equal table references; used, cached-free and free
        partition the pool; the hash map points at the blocks that carry the hashes."""
        refs = [0] * self.pool.num_blocks
        for t in self.tables.values():
            for b in t.block_ids:
                refs[b] += 1
            assert t.num_used_blocks <= len(t.block_ids), "table shorter than its tokens"
        cached_free = 0
        for blk in self.pool.blocks:
            assert blk.ref_cnt == refs[blk.block_id], (
                f"block {blk.block_id}: ref {blk.ref_cnt} != {refs[blk.block_id]} holders")
            in_free = self.pool.is_free(blk.block_id)
            assert in_free == (blk.ref_cnt == 0), f"block {blk.block_id} free-queue mismatch"
            if blk.block_hash is not None:
                assert self.pool.cached[blk.block_hash] == blk.block_id
                cached_free += in_free
        assert cached_free == self.pool.num_cached_free
        assert len(self.pool.cached) == sum(b.block_hash is not None for b in self.pool.blocks)
