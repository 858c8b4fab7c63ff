"""One layer group's block tables (vLLM v1's SingleTypeKVCacheManager): full attention, a
sliding window of W keys, or a recurrent state (kv.groups: a window of 2 whose blocks each hold
the state after their last token).

It allocates from the shared pool, grows tables with copy-on-write of a shared partial
block, forks, frees, rolls back drafts and registers full blocks in the prefix cache under
its group's keys. The coordinator (manager.KVCacheManager) calls every group alike and
checks that all of a step's blocks fit before any group takes one.

Sliding window (vLLM v1's SlidingWindowManager): a block wholly below the window of every
query a sequence will still run is released as the sequence moves on. Its entry becomes
RELEASED (-1), so the table keeps its logical numbering; the block goes back to the free
queue with its hash, hittable until evicted.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import xxhash

from ..util import cdiv
from .block_pool import BlockPool
from .block_table import RELEASED, BlockTable
from .events import KVEventLog
from .groups import KV, STATE, STATE_WINDOW, group_kind
from .hashing import BlockHashes

Copies = list[tuple[int, int]]


def group_salt(gid: int) -> int:
    """XORed into a block key for group gid's blocks: each group caches its own blocks of a
    prefix (group 0, the full-attention one, keeps the plain key: the tier's and the
    router's)."""
    return xxhash.xxh3_64_intdigest(f"pagedllm-kv-group-{gid}".encode()) if gid else 0


class GroupManager:
    def __init__(self, gid: int, window: int, pool: BlockPool, block_size: int, policy: str = "paged",
                 reserve_blocks: int = 0, emit: Callable[[dict], None] | None = None, holds: str = KV) -> None:
        if holds == STATE and (window != STATE_WINDOW or policy != "paged"):
            raise ValueError(f"a state group is paged with window {STATE_WINDOW}, got window {window}, {policy}")
        self.gid, self.pool, self.block_size, self.holds = gid, pool, block_size, holds
        self.window = window if policy == "paged" else 0
        self.policy, self.reserve_blocks = policy, reserve_blocks
        self.salt = group_salt(gid)
        self.tables: dict[int, BlockTable] = {}
        self.released = 0          # blocks the window released from tables
        self.cow_copies = 0
        self._emit = emit or (lambda ev: None)
        # (block, key): a block registered in the prefix cache under this group's key (the tier writes it through)
        self.on_cached: Callable[[int, int], None] | None = None
        self.log: KVEventLog | None = None   # vLLM's KV events, while a publisher listens
        self.in_flight: set[int] | None = None   # a state group's blocks registered this step (not hittable yet)

    @property
    def kind(self) -> str:
        return group_kind(self.window, self.holds)

    def emit(self, event: dict) -> None:
        if self.gid:
            event["group"] = self.gid
        self._emit(event)

    def keys(self, hashes: BlockHashes, end: int | None = None) -> list[int]:
        """This group's keys of a sequence's full blocks (up to block `end`)."""
        keys = hashes.keys[:end]
        return keys if not self.salt else [k ^ self.salt for k in keys]

    # -- prefix hits ---------------------------------------------------------
    def first_window_block(self, first_query: int) -> int:
        """The first logical block a query at `first_query` or later can read: the blocks
        before it hold only keys j <= first_query - W (0 without a window)."""
        return max(0, first_query - self.window + 1) // self.block_size if self.window else 0

    def cached(self, keys: Sequence[int]) -> list[int]:
        """The cached block of each key, RELEASED where none (without a window: the leading run)."""
        if not self.window:
            return list(itertools.takewhile(lambda b: b is not None, map(self.pool.lookup, keys)))
        pending = self.in_flight or ()
        return [RELEASED if b is None or b in pending else b for b in map(self.pool.lookup, keys)]

    def lookup(self, key: int) -> int | None:
        """The cached block of one of this group's keys, if a hit may take it (a state block
        registered this step is not written yet)."""
        b = self.pool.lookup(key)
        return None if b is not None and self.in_flight and b in self.in_flight else b

    def longest_hit(self, blocks: Sequence[int], num_blocks: int) -> int:
        """The most blocks, at most num_blocks, that serve a prefix hit among `blocks` (cached
        ones, RELEASED where missing). Without a window: the leading run. With one, a hit of k
        blocks needs only those its queries (from k * B on) read: first_window_block(k * B)
        .. k - 1 (vLLM's SlidingWindowManager rule). Keys chain every token before a block,
        so what is found is exact either way."""
        n = min(num_blocks, len(blocks))
        if not self.window:
            return next((i for i in range(n) if blocks[i] == RELEASED), n)
        last_missing, best = -1, 0
        for k in range(1, n + 1):
            if blocks[k - 1] == RELEASED:
                last_missing = k - 1
            elif last_missing < self.first_window_block(k * self.block_size):
                best = k
        return best

    # -- allocation ----------------------------------------------------------
    def admit_cost(self, num_tokens: int, hit: Sequence[int], first_query: int) -> int:
        """Free blocks admit() takes: fresh ones past the hit and the hit's cached-free blocks
        (they leave the free queue when touched); the hit's entries below the window of the
        first query are not taken. Reserve-max: its whole run."""
        if self.policy == "reserve-max":
            return self.reserve_blocks
        skip = min(self.first_window_block(first_query), len(hit))
        revived = sum(1 for b in hit[skip:] if b != RELEASED and self.pool.is_available(b))
        return max(0, cdiv(num_tokens, self.block_size) - len(hit)) + revived

    def admit(self, seq_id: int, hit: Sequence[int], hashes: BlockHashes, first_query: int,
              queried: int = 0) -> BlockTable | None:
        """A new sequence's table over its prefix hit (each block +1), or a whole max_model_len
        reservation (reserve-max; None if no contiguous run is free). Its fresh blocks come
        from extend(), once every group has taken its hit: a fresh block may evict a cached-
        free block, which must not be another group's hit. The caller checked admit_cost."""
        B = self.block_size
        if self.policy == "reserve-max":
            run = self.pool.allocate_run(self.reserve_blocks)
            if run is None:  # too few free blocks, or none contiguous: external fragmentation
                return None
            table = BlockTable(B, run, hashes=hashes)
            self.emit({"type": "alloc", "seq": seq_id, "blocks": list(run)})
        else:
            skip = min(self.first_window_block(first_query), len(hit))
            taken = list(hit[skip:])
            if RELEASED in taken:
                raise ValueError(f"prefix hit: block {skip + taken.index(RELEASED)} is missing but the window of "
                                 f"the query at {first_query} reads it")
            for b in taken:
                self.pool.touch(b)
            table = BlockTable(B, [RELEASED] * skip + taken, len(hit) * B, hashes, num_cached_blocks=len(hit),
                               num_released=skip)
            self.emit({"type": "hit", "seq": seq_id, "blocks": list(table.block_ids), "tokens": len(hit) * B,
                       "queried": queried})
        self.tables[seq_id] = table
        return table

    def extend(self, seq_id: int, table: BlockTable, num_tokens: int) -> None:
        """Fresh blocks for a new sequence's tokens past its hit."""
        self._append(seq_id, table, self._new_blocks(table, num_tokens))

    def grow_cost(self, table: BlockTable, num_tokens: int) -> int:
        """Free blocks grow() takes: fresh ones and a copy of a shared partial last block."""
        return self._new_blocks(table, num_tokens) + self._must_copy(table, num_tokens)

    def grow(self, seq_id: int, table: BlockTable, num_tokens: int) -> Copies:
        """Room for a known sequence's next tokens (the caller has checked grow_cost fits): a
        private copy of its partial last block if others can read it, then fresh blocks."""
        copies = [self._copy_on_write(seq_id, table)] if self._must_copy(table, num_tokens) else []
        self._append(seq_id, table, self._new_blocks(table, num_tokens))
        return copies

    def _new_blocks(self, table: BlockTable, num_tokens: int) -> int:
        return 0 if self.policy == "reserve-max" else max(0, cdiv(num_tokens, self.block_size) - len(table.block_ids))

    def _must_copy(self, table: BlockTable, num_tokens: int) -> bool:
        """A block is written in place only if this sequence alone holds it and it is not
        in the prefix cache (a cached block's content is registered under its hash)."""
        start, B = table.num_tokens, self.block_size
        if start % B == 0 or start >= num_tokens:
            return False
        blk = self.pool.blocks[table.block_ids[start // B]]
        return blk.ref_cnt > 1 or blk.block_hash is not None

    def _copy_on_write(self, seq_id: int, table: BlockTable) -> tuple[int, int]:
        i = table.num_tokens // self.block_size
        src = table.block_ids[i]
        dst = self.pool.allocate()
        self.pool.release([src])
        table.block_ids[i] = dst
        self.cow_copies += 1
        self.emit({"type": "cow", "seq": seq_id, "index": i, "src": src, "dst": dst})
        return src, dst

    def _append(self, seq_id: int, table: BlockTable, n: int) -> None:
        if n:
            fresh = [self.pool.allocate() for _ in range(n)]
            table.block_ids.extend(fresh)
            self.emit({"type": "alloc", "seq": seq_id, "blocks": fresh})

    def slide(self, seq_id: int, table: BlockTable, first_query: int) -> None:
        """Release the blocks no query from `first_query` on reads (the sliding window):
        their entries become RELEASED; each keeps its hash in the free queue."""
        if not self.window:
            return
        end = min(self.first_window_block(first_query), table.num_tokens // self.block_size)
        start = table.num_released
        if end <= start:
            return
        gone = table.block_ids[start:end]
        table.block_ids[start:end] = [RELEASED] * len(gone)
        table.num_released = end
        # Oldest first, so evicted first: a later hit under the window needs the blocks just
        # before where it ends, not a prefix's head (free() releases tail first, as without one).
        self.pool.release(gone)
        self.released += len(gone)
        self.emit({"type": "slide", "seq": seq_id, "index": start, "blocks": gone})

    def cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int], verified: int) -> None:
        """Register each newly filled full block among the first `verified` tokens under its
        key (computed once per sequence); a block holding a draft token waits."""
        full = min(verified, len(token_ids)) // self.block_size
        if full <= table.num_cached_blocks:
            return
        keys = table.hashes.update(token_ids)
        start = table.num_cached_blocks
        for i in range(start, full):
            b = table.block_ids[i]
            # A block the window released before its tokens were verified here: not this table's to register.
            if b != RELEASED and self.pool.cache(b, keys[i] ^ self.salt):
                if self.in_flight is not None:
                    self.in_flight.add(b)
                self.emit({"type": "cache", "block": b})
                if self.on_cached is not None:
                    self.on_cached(b, keys[i] ^ self.salt)
        table.num_cached_blocks = full
        if self.log is not None:
            self.announce(table, token_ids, start, full)

    def announce(self, table: BlockTable, token_ids: Sequence[int], start: int, end: int) -> None:
        """Tell the event log of blocks start..end-1 of a table (those it holds; the log skips
        the ones it announced before)."""
        i = start
        while i < end:
            if table.block_ids[i] == RELEASED:
                i += 1
                continue
            j = i
            while j < end and table.block_ids[j] != RELEASED:
                j += 1
            self._stored(table.hashes, token_ids, i, j)
            i = j

    def announce_loaded(self, hashes: BlockHashes, token_ids: Sequence[int], i: int) -> None:
        """Tell the event log of a prompt's block i read from the tier into the pool: hittable from
        now on, whether or not a table takes it (a hit that falls back, or an admission that does
        not fit, leaves it cached)."""
        self._stored(hashes, token_ids, i, i + 1)

    def _stored(self, hashes: BlockHashes, token_ids: Sequence[int], i: int, j: int) -> None:
        """The event of a prompt's blocks i..j-1 stored, under this group's salted keys."""
        B, keys, salt = self.block_size, hashes.keys, self.salt
        self.log.stored(self.gid, [k ^ salt for k in keys[i:j]], keys[i - 1] ^ salt if i else None,
                        token_ids[i * B:j * B], salted=hashes.salt is not None)

    # -- sequences -----------------------------------------------------------
    def fork(self, parent_id: int, child_id: int, n: int, hashes: BlockHashes) -> Copies | None:
        """The child's table over the parent's first n tokens: shared blocks (paged), or its
        own reservation with the filled blocks copied (reserve-max; None if none is free)."""
        parent = self.tables[parent_id]
        self.check_fork(parent, n)
        B, k = self.block_size, cdiv(n, self.block_size)
        child = BlockTable(B, num_tokens=n, hashes=hashes, num_cached_blocks=min(parent.num_cached_blocks, n // B),
                           num_released=min(parent.num_released, k))
        copies: Copies = []
        if self.policy == "reserve-max":
            run = self.pool.allocate_run(self.reserve_blocks)
            if run is None:
                return None
            child.block_ids = run
            copies = list(zip(parent.block_ids[:k], run[:k]))
        else:
            child.block_ids = parent.block_ids[:k]
            for b in child.held:
                self.pool.touch(b)
        self.tables[child_id] = child
        self.emit({"type": "fork", "parent": parent_id, "seq": child_id, "blocks": list(child.block_ids),
                   "tokens": n, "shared": self.policy == "paged"})
        return copies

    def check_fork(self, parent: BlockTable, n: int) -> None:
        """ValueError if a child of the first n tokens of `parent` could not read what its next
        query reads: keys the window released, or (a state group) a state the parent's blocks no
        longer hold; a state is kept at each block's end and at the last token only."""
        released = parent.num_released > self.first_window_block(n)
        if self.holds == STATE and n != parent.num_tokens and (n % self.block_size or released):
            raise ValueError(f"fork at {n} of {parent.num_tokens} tokens: a recurrent state is kept at the last "
                             f"token, and at block ends ({self.block_size} tokens) only until the next step")
        if released:
            raise ValueError(f"fork at {n} tokens: the sliding window released keys the child's next query reads")

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks, tail first (its tail is the least likely reused)."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            tail_first = table.held[::-1]
            self.pool.release(tail_first)
            self.emit({"type": "free", "seq": seq_id, "blocks": tail_first})

    def rollback(self, seq_id: int, num_tokens: int, held: int, token_ids: Sequence[int]) -> list[int]:
        """Keep `held` slots, the first num_tokens of them verified; give back the blocks only
        rejected drafts filled (paged; reserve-max keeps its reservation)."""
        table = self.tables[seq_id]
        self.check_rollback(table, num_tokens, held)
        rejected = table.num_tokens - held
        freed: list[int] = []
        if self.policy == "paged":
            keep = cdiv(held, self.block_size)  # > num_released: the check above
            freed = table.block_ids[keep:][::-1]
            del table.block_ids[keep:]
            self.pool.release(freed)
        table.num_tokens = held
        # rejected 0: every draft kept, the lookahead slots are verified now
        self.emit({"type": "rollback", "seq": seq_id, "tokens": held, "rejected": rejected, "blocks": freed})
        self.cache_full_blocks(table, token_ids, num_tokens)
        return freed

    def check_rollback(self, table: BlockTable, num_tokens: int, held: int) -> None:
        """ValueError if rolling `table` back to num_tokens verified of `held` slots would leave
        its next query without what it reads: released keys, or a state already run past them
        (a recurrent state is updated in place: it cannot be taken back)."""
        if table.num_released > self.first_window_block(num_tokens):
            raise ValueError(f"rollback to {num_tokens} tokens: the sliding window released keys its next query reads")
        if self.holds == STATE and held < table.num_tokens:
            raise ValueError(f"rollback to {held} of {table.num_tokens} tokens: a recurrent state cannot be rolled "
                             "back (speculative decoding is not supported for a model with state layers)")

    # -- figures -------------------------------------------------------------
    def walk_slots(self, fill: dict[int, int]) -> int:
        """Fill `fill` (block -> slots holding a token, a shared block once) from this group's
        tables; returns the blocks its tables would hold unshared."""
        B, without_sharing = self.block_size, 0
        for t in self.tables.values():
            without_sharing += t.num_held_used_blocks
            full = t.num_tokens // B
            # A table's leading blocks are full: B, the most any holder can fill, so they are
            # set without comparing (in C; a table is mostly full blocks). Its last few compare.
            fill.update(dict.fromkeys(t.block_ids[t.num_released:full], B))
            for i in range(max(full, t.num_released), len(t.block_ids)):
                b, f = t.block_ids[i], max(0, t.num_tokens - i * B)
                if f > fill.get(b, -1):
                    fill[b] = f
        return without_sharing

    def count_refs(self, refs: list[int]) -> None:
        """Add this group's table references to `refs` (the integrity check)."""
        for t in self.tables.values():
            assert all(b == RELEASED for b in t.block_ids[:t.num_released]), "released entries must lead the table"
            for b in t.held:
                assert 0 <= b < len(refs), f"table entry {b} after the released ones"
                refs[b] += 1
            assert t.num_used_blocks <= len(t.block_ids), "table shorter than its tokens"
