"""The KV cache manager: who holds which physical block. Plain Python, no torch.

It speaks in block ids and slot numbers only. Copy-on-write and fork decisions are
made here and returned as (src, dst) block pairs for the model runner to copy.

Sliding window (vLLM v1's SlidingWindowManager, in one table): when every layer of the
model sees only the last W keys (a query at position p reads keys j with p - W < j <= p),
a block that lies wholly below the window of every query a sequence will still run is
released as the sequence moves on. Its table entry becomes RELEASED (-1), so the table
keeps its logical numbering; the block goes back to the free queue with its hash, still
hittable until evicted.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

from .block_pool import BlockPool
from .block_table import RELEASED, BlockTable
from ..config import ALLOCATION_POLICIES, OFFLOAD_WRITE_POLICIES
from ..util import cdiv
from .hashing import BlockHashes
from .pool_shape import PoolShape, window_blocks
from .tier_store import TierStats, TierStore

POLICIES = ALLOCATION_POLICIES
WRITE_POLICIES = OFFLOAD_WRITE_POLICIES


@dataclass(slots=True)
class KVStats:
    num_blocks: int
    block_size: int
    # A block is exactly one of these three: used + cached_free + free = num_blocks.
    used_blocks: int          # ref > 0
    cached_free_blocks: int   # ref 0, still hittable by a prefix
    free_blocks: int          # ref 0, holding nothing (BlockPool.num_available = cached_free + free)
    usage: float              # U_kv: allocated blocks / all blocks
    # The three figures that walk every block table (None in a stats(walk=False) snapshot):
    used_slots: int | None    # slots that hold a token (a shared block counts once)
    waste: float | None       # eta: (allocated - used) / allocated slots
    blocks_without_sharing: int | None
    prefix_queries: int       # tokens looked up in the prefix cache
    prefix_hits: int          # tokens served from it
    cow_copies: int
    forks: int
    evictions: int
    shared_blocks: int = 0    # blocks held by more than one table
    # Prompt logprobs kept beside cached blocks: prompt tokens of prompt-logprob requests
    # looked up (their first has none), those whose logprobs came from the cache, and the
    # blocks that hold such an entry. Counted apart from the KV hits above.
    prompt_logprob_queries: int = 0
    prompt_logprob_hits: int = 0
    prompt_logprob_blocks: int = 0
    # Sliding window: blocks released from tables because no later query reads them.
    window_released: int = 0
    # The second tier (--kv-offload-dir): prefix-hit tokens whose blocks were loaded from it
    # (part of prefix_hits), blocks loaded, blocks handed to it (write-through, write-back,
    # swap), write-through blocks waiting while too many writes are in flight, sequences preempted
    # by swap and the blocks they saved; the store's own figures (None without a tier).
    tier_hits: int = 0
    tier_loaded_blocks: int = 0
    tier_offloaded_blocks: int = 0
    tier_backlog: int = 0      # write-through blocks waiting for the disk to catch up
    swap_outs: int = 0
    swap_out_blocks: int = 0
    tier: TierStats | None = None

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def tier_hit_rate(self) -> float:
        """Share of the prompt tokens looked up that the tier served."""
        return self.tier_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def prompt_logprob_hit_rate(self) -> float:
        return self.prompt_logprob_hits / self.prompt_logprob_queries if self.prompt_logprob_queries else 0.0


def _leading(get: Callable, keys: Sequence[int]) -> list:
    """get(key) for the leading keys that have a value: a prefix stops at its first miss."""
    return list(itertools.takewhile(lambda v: v is not None, map(get, keys)))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 policy: str = "paged", max_model_len: int | None = None, sliding_window: int = 0,
                 max_step_tokens: int = 0, tier: TierStore | None = None,
                 write_policy: str = "write_through") -> None:
        """sliding_window: W, the keys every query sees (0: all of them); blocks below the
        window are released under the paged policy (reserve-max keeps its reservation).
        max_step_tokens: the most tokens one sequence gets slots for in a step (its chunk
        and lookahead), which bounds what it holds under the window (PoolShape).
        tier: the second tier of the prefix cache (TierStore), written through as full blocks
        are cached, or back as they are evicted (write_policy)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: full attention), got {sliding_window}")
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
        self.sliding_window = sliding_window if policy == "paged" else 0
        bound = window_blocks(sliding_window, block_size, max_step_tokens) if sliding_window and max_step_tokens else 0
        self.shape = PoolShape.of(num_blocks, block_size, policy, max_model_len, bound)
        self.reserve_blocks = self.shape.reserve_blocks
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
        self.prompt_logprob_queries = 0
        self.prompt_logprob_hits = 0
        self.window_released = 0
        self._init_tier(tier, write_policy)

    def watch(self, listener: Callable[[dict], None] | None) -> None:
        """Send every block-level change to `listener` (None: stop)."""
        self.listener = listener
        self._hook_evictions()

    def _hook_evictions(self) -> None:
        """Evictions matter to a listener and to a write-back tier; with neither, they cost nothing."""
        wanted = self.listener is not None or self.tier is not None
        self.pool.on_evict = self._on_evict if wanted else None

    def _on_evict(self, block_id: int, key: int) -> None:
        """A cached-free block is reused: the tier gets it first if it lacks it and wants it
        (write-back; write-through: one still waiting in the backlog)."""
        if self.tier is not None:
            self._fresh_loads.discard(block_id)
            queued = self._backlog.pop(key, None) is not None
            if (queued or self.write_policy == "write_back") and key not in self.tier:
                self._save(block_id, key)
        self._emit({"type": "evict", "block": block_id})

    # -- the second tier -----------------------------------------------------
    # Three kinds of IO, each a list of (block id, ...) for the runner, which carries them out
    # in this order at the start of a step: `saves` (copy the block's bytes now, then write:
    # the block is about to be reused: write-back eviction, swap-out), `loads` (tier bytes
    # into a fresh block, before anyone reads it), and after the forward `writes` (write the
    # block in place: write-through; pinned, so nobody reuses it until written).
    def _init_tier(self, tier: TierStore | None, write_policy: str) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv_offload_write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if tier is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir needs the prefix cache (its blocks are kept under their hashes): "
                             "drop --no-enable-prefix-caching or the tier")
        if tier is not None and self.sliding_window:
            raise ValueError("kv_offload_dir with a sliding-window model is not supported: its released blocks "
                             "would be loaded back for nothing")
        self.tier = tier
        self.write_policy = write_policy
        self.pins: dict[int, int] = {}        # block id -> pins (a write in flight, a load this step)
        self._writing: dict[int, int] = {}    # key -> block id, written in place (pinned)
        # Write-through blocks beyond max_inflight, oldest first (key -> block id): written as the
        # disk catches up, or saved when the pool evicts them before that.
        self._backlog: dict[int, int] = {}
        self._load_pins: list[int] = []
        self._fresh_loads: set[int] = set()   # loaded blocks no admission has hit yet
        self.saves: list[tuple[int, int]] = []
        self.loads: list[tuple[int, object]] = []
        self.writes: list[tuple[int, int]] = []
        # Writes in place pin their blocks: at most a quarter of the pool waits on the disk.
        self.max_inflight = max(1, self.pool.num_blocks // 4)
        self.tier_hits = self.tier_loaded_blocks = self.tier_offloaded_blocks = 0
        self.swap_outs = self.swap_out_blocks = 0
        self._hook_evictions()

    def _pin(self, blocks: list[int]) -> None:
        """A reference that no table holds: the block stays as it is until unpinned."""
        for b in blocks:
            self.pool.touch(b)
            self.pins[b] = self.pins.get(b, 0) + 1
        if blocks:
            self._emit({"type": "pin", "blocks": list(blocks)})

    def _unpin(self, blocks: list[int]) -> None:
        for b in blocks:
            n = self.pins.pop(b) - 1
            if n:
                self.pins[b] = n
        self.pool.release(blocks)
        if blocks:
            self._emit({"type": "unpin", "blocks": list(blocks)})

    def _save(self, block_id: int, key: int) -> None:
        self.saves.append((block_id, key))
        self.tier_offloaded_blocks += 1

    def _write_through(self, block_id: int, key: int) -> None:
        if key in self.tier or key in self._writing:
            return
        if len(self._writing) >= self.max_inflight:  # the disk is behind: keep the pool for the batch
            self._backlog[key] = block_id
            return
        self._pin([block_id])
        self._writing[key] = block_id
        self.writes.append((block_id, key))
        self.tier_offloaded_blocks += 1

    def begin_step(self) -> None:
        """Before a step is scheduled: last step's loads are in their blocks, and the writes
        finished since give their blocks back."""
        if self.tier is None:
            return
        self._unpin(self._load_pins)
        self._load_pins = []
        written = [self._writing.pop(key) for key, _ in self.tier.take_done() if key in self._writing]
        self._unpin(written)
        while self._backlog and len(self._writing) < self.max_inflight:
            key = next(iter(self._backlog))
            b = self._backlog.pop(key)
            if self.pool.blocks[b].block_hash == key:
                self._write_through(b, key)

    def take_tier_io(self) -> tuple[list[tuple[int, int]], list[tuple[int, object]], list[tuple[int, int]]]:
        """This step's (saves, loads, writes) for the runner; the lists start anew."""
        io = self.saves, self.loads, self.writes
        if self.listener is not None and (self.saves or self.writes):
            self.listener({"type": "offload", "blocks": [b for b, _ in self.saves + self.writes]})
        self.saves, self.loads, self.writes = [], [], []
        return io

    def tier_prefix(self, hashes: BlockHashes, num_tokens: int, hit: Sequence[int]) -> int:
        """Blocks the tier holds right after a pool hit of `hit` blocks, of a sequence of
        `num_tokens` tokens (never its last token: that one is computed for its logits)."""
        if self.tier is None:
            return 0
        n = 0
        for key in hashes.keys[len(hit):(num_tokens - 1) // self.block_size]:
            if key not in self.tier and key not in self.pool.cached:
                break
            n += 1
        return n

    def load_from_tier(self, seq_id: int, hashes: BlockHashes, num_tokens: int, hit: Sequence[int],
                       limit: int) -> list[int]:
        """Extend a pool hit with blocks read from the tier (at most `limit`, leaving the pool
        a block): each read is verified, put in a fresh block registered under its key and
        pinned for this step; the runner copies the bytes in before the forward. The hit's
        own blocks are pinned first, so a fresh block never evicts one of them. Stops at the
        first block the tier lacks or cannot serve (that one is recomputed)."""
        n = min(self.tier_prefix(hashes, num_tokens, hit), limit)
        if n <= 0:
            return []
        self._pin(list(hit))
        self._load_pins += hit
        got: list[int] = []
        for key in hashes.keys[len(hit):len(hit) + n]:
            b = self.pool.lookup(key)   # after a gap, the pool may hold later blocks itself
            if b is not None:
                self._pin([b])
            elif self.pool.num_available <= 1 or (payload := self.tier.read(key)) is None:
                break
            else:
                b = self.pool.allocate()
                self.pool.cache(b, key)
                self.pins[b] = self.pins.get(b, 0) + 1   # allocate() gave it its one reference
                self._fresh_loads.add(b)
                self.loads.append((b, payload))
                self.tier_loaded_blocks += 1
                self._emit({"type": "tier_load", "seq": seq_id, "block": b, "index": len(hit) + len(got)})
            self._load_pins.append(b)
            got.append(b)
        return list(hit) + got

    def swap_out(self, seq_id: int) -> int:
        """A sequence preempted by swap: its full blocks that the tier lacks and no other table
        holds are saved to it before they can be reused; it resumes through a prefix hit (pool,
        else tier). Its partial last block (fewer than B tokens) is recomputed. Returns the
        blocks saved."""
        table = self.tables.get(seq_id)
        if table is None or self.tier is None:
            return 0
        saved = []
        for i in range(table.num_released, table.num_cached_blocks):
            key, b = table.hashes.keys[i], table.block_ids[i]
            # A block another table holds stays in the pool; if it leaves later, the tier gets it
            # then (write-back saves at eviction; write-through has written it, or its backlog does).
            if key not in self.tier and key not in self._writing and self.pool.blocks[b].ref_cnt == 1:
                self._save(b, key)
                saved.append(b)
        self.swap_outs += 1
        self.swap_out_blocks += len(saved)
        self._emit({"type": "swap_out", "seq": seq_id, "blocks": saved})
        return len(saved)

    def blocks_to_flush(self) -> list[tuple[int, int]]:
        """Every cached block the tier lacks, as (block, key), for a clean shutdown (write-back:
        all it kept; write-through: its backlog)."""
        if self.tier is None:
            return []
        return [(b, key) for key, b in self.pool.cached.items() if key not in self.tier and key not in self._writing]

    def new_hashes(self, salt: str | None = None) -> BlockHashes:
        """Block keys for a new sequence, sized to this pool's blocks."""
        return BlockHashes(self.block_size, salt)

    # -- prefix cache --------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], hashes: BlockHashes | None = None) -> list[int]:
        """Blocks of the longest cached full-block prefix. It never covers the last
        token: that one must be computed to produce logits. `hashes` are the sequence's
        own keys (computed once, kept across lookups); None hashes unsalted, afresh."""
        if not self.enable_prefix_caching:
            return []
        keys = self._hashes(hashes).update(token_ids)[:(len(token_ids) - 1) // self.block_size]
        if not self.sliding_window:
            return _leading(self.pool.lookup, keys)
        found = [self.pool.lookup(k) for k in keys]
        return self.shorten_hit([RELEASED if b is None else b for b in found], len(found))

    def shorten_hit(self, blocks: Sequence[int], num_blocks: int) -> list[int]:
        """The longest prefix hit of at most num_blocks blocks among `blocks` (cached ones,
        RELEASED where missing). Without a window, a hit is a run of leading blocks. With
        one, a hit of k blocks needs only the blocks its queries (from k * B on) read:
        first_window_block(k * B) .. k - 1; the ones before may be missing (vLLM's
        SlidingWindowManager rule). Keys chain every token before a block, so what is
        found is exact either way."""
        if not self.sliding_window:
            return list(itertools.takewhile(lambda b: b != RELEASED, blocks[:num_blocks]))
        last_missing, best = -1, 0
        for k in range(1, min(num_blocks, len(blocks)) + 1):
            if blocks[k - 1] == RELEASED:
                last_missing = k - 1
            elif last_missing < self.first_window_block(k * self.block_size):
                best = k
        return list(blocks[:best])

    def first_window_block(self, first_query: int) -> int:
        """The first logical block that a query at `first_query` or later can read: the
        blocks before it hold only keys j <= first_query - W (0 without a window)."""
        if not self.sliding_window:
            return 0
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    # -- prompt logprobs kept beside cached blocks ---------------------------
    def cached_prompt_scores(self, hashes: BlockHashes, num_blocks: int) -> list:
        """What is kept beside the first `num_blocks` blocks of a prefix hit, up to the first
        block without it (a block computed without logits): block b's entry holds its own
        tokens' prompt logprobs, b * B .. b * B + B - 1 (block 0 from token 1)."""
        return _leading(self.pool.attachment, hashes.keys[:num_blocks])

    def count_prompt_scores(self, queried: int, served: int) -> None:
        """An admitted prompt-logprob request: prompt tokens it scores, those served from the cache."""
        if not self.enable_prefix_caching:
            return
        self.prompt_logprob_queries += queried
        self.prompt_logprob_hits += served

    def keep_prompt_scores(self, hashes: BlockHashes, index: int, entry: object) -> bool:
        """Keep a full block's prompt logprobs beside it while it stays cached (`index`: the
        block's place in the sequence, whose key it is). False if it is not cached."""
        if not self.enable_prefix_caching or index >= len(hashes.keys):
            return False
        return self.pool.attach(hashes.keys[index], entry)

    def _hashes(self, hashes: BlockHashes | None) -> BlockHashes:
        if hashes is None:
            return self.new_hashes()
        if hashes.block_size != self.block_size:
            raise ValueError(f"block hashes of {hashes.block_size}-token blocks used with {self.block_size}-token blocks")
        return hashes

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                       cached_blocks: Sequence[int] = (), hashes: BlockHashes | None = None,
                       lookahead: int = 0, first_query: int | None = None) -> list[tuple[int, int]] | None:
        """Give sequence `seq_id` slots for its first `num_tokens` tokens.

        A sequence not yet known starts from `cached_blocks` (a prefix hit) and keeps
        `hashes` (its block keys) for caching its full blocks. `lookahead`: how many of
        the last of those tokens are speculative (drafts, or slots a draft model writes its
        next proposal into), beyond `token_ids`; their slots are lookahead slots, kept or
        taken back by rollback() once verified, never cached. Returns the
        copy-on-write pairs the runner must copy before writing, or None if the pool
        cannot fit it now, in which case nothing has changed but the window's release.

        `first_query`: the first position whose query runs now (default: the first new
        slot); no later query runs before it, even after a rollback. Under a sliding
        window the blocks no query from there on reads are released first, fitting or not.
        """
        table = self.tables.get(seq_id)
        start = len(cached_blocks) * self.block_size if table is None else table.num_tokens
        if num_tokens < start:
            raise ValueError(f"num_tokens {num_tokens} < tokens already held {start}")
        first_query = start if first_query is None else first_query
        if not 0 <= first_query <= start:  # the tokens from the first new slot on are computed now
            raise ValueError(f"first_query {first_query} outside [0, {start}]")
        if table is None:
            table = self._admit(seq_id, token_ids, num_tokens, cached_blocks, self._hashes(hashes), first_query)
            if table is None:
                return None
            copies: list[tuple[int, int]] = []
        else:
            self._slide(seq_id, table, first_query)  # first: what it releases may serve the growth
            copies = self._grow(seq_id, table, num_tokens)
            if copies is None:
                return None
        table.num_tokens = num_tokens
        if self.listener is not None:
            ev = {"type": "fill", "seq": seq_id, "tokens": num_tokens}
            if lookahead:  # speculative decoding: the last `lookahead` slots hold unverified drafts
                ev["lookahead"] = lookahead
            self.listener(ev)
        self._cache_full_blocks(table, token_ids, num_tokens - lookahead)
        return copies

    def rollback(self, seq_id: int, num_tokens: int, token_ids: Sequence[int], lookahead: int = 0) -> list[int]:
        """After verification: keep the first `num_tokens` slots (the tokens whose KV is
        now right) and `lookahead` unverified slots past them, give back the blocks only
        rejected drafts filled, and register the full blocks among the kept tokens
        (`token_ids`: at least those tokens). A block is never cached from an unverified
        token. Returns the blocks freed."""
        table = self.tables[seq_id]
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"rollback to {num_tokens} tokens outside [0, {table.num_tokens}]")
        if len(token_ids) < num_tokens:
            raise ValueError(f"rollback: {len(token_ids)} token ids for {num_tokens} kept tokens")
        if table.num_released > self.first_window_block(num_tokens):
            raise ValueError(f"rollback to {num_tokens} tokens: the sliding window released keys its next query reads")
        held = min(table.num_tokens, num_tokens + max(0, lookahead))
        rejected = table.num_tokens - held
        freed: list[int] = []
        if self.policy == "paged":  # reserve-max keeps its whole reservation
            keep = cdiv(held, self.block_size)  # > num_released: the check above
            freed = table.block_ids[keep:][::-1]
            del table.block_ids[keep:]
            self.pool.release(freed)
        table.num_tokens = held
        if self.listener is not None:  # rejected 0: every draft kept, the lookahead slots are verified now
            self.listener({"type": "rollback", "seq": seq_id, "tokens": held, "rejected": rejected,
                           "blocks": freed})
        self._cache_full_blocks(table, token_ids, num_tokens)
        return freed

    def _admit(self, seq_id: int, token_ids: Sequence[int], num_tokens: int, cached_blocks: Sequence[int],
               hashes: BlockHashes, first_query: int) -> BlockTable | None:
        """A new sequence's table: its prefix hit plus fresh blocks (paged), or a whole
        max_model_len reservation (reserve-max). None, changing nothing, if it does not fit.
        Under a sliding window the hit's blocks below the window of `first_query` are not
        taken (RELEASED entries); those it reads must be there."""
        B = self.block_size
        if self.policy == "reserve-max":
            run = self.pool.allocate_run(self.reserve_blocks)
            if run is None:  # too few free blocks, or none contiguous: external fragmentation
                return None
            table = BlockTable(B, run, hashes=hashes)
            self._emit({"type": "alloc", "seq": seq_id, "blocks": list(run)})
        else:
            skip = min(self.first_window_block(first_query), len(cached_blocks))
            taken = list(cached_blocks[skip:])
            if RELEASED in taken:
                raise ValueError(f"prefix hit: block {skip + taken.index(RELEASED)} is missing but the window of "
                                 f"the query at {first_query} reads it")
            if self._fresh_blocks(num_tokens, len(cached_blocks)) + self._revived(taken) > self.pool.num_available:
                return None
            for b in taken:
                self.pool.touch(b)
            hit = len(cached_blocks) * B
            table = BlockTable(B, [RELEASED] * skip + taken, hit, hashes, num_cached_blocks=len(cached_blocks),
                               num_released=skip)
            if self.enable_prefix_caching:
                self.prefix_queries += len(token_ids)
                self.prefix_hits += hit
                if self._fresh_loads:
                    loaded = self._fresh_loads.intersection(taken)
                    self.tier_hits += len(loaded) * B
                    self._fresh_loads -= loaded
            self._emit({"type": "hit", "seq": seq_id, "blocks": list(table.block_ids), "tokens": hit,
                        "queried": len(token_ids)})
            self._append(seq_id, table, max(0, cdiv(num_tokens, B) - len(cached_blocks)))
        self.tables[seq_id] = table
        return table

    def _grow(self, seq_id: int, table: BlockTable, num_tokens: int) -> list[tuple[int, int]] | None:
        """Room for a known sequence's next tokens: a private copy of its partial last
        block if others can read it, then fresh blocks. None, changing nothing, if short."""
        need = self._new_blocks(table, num_tokens)
        cow = self._must_copy(table, num_tokens)
        if need + cow > self.pool.num_available:
            return None
        copies = [self._copy_on_write(seq_id, table)] if cow else []
        self._append(seq_id, table, need)
        return copies

    def _new_blocks(self, table: BlockTable, num_tokens: int) -> int:
        return 0 if self.policy == "reserve-max" else max(0, cdiv(num_tokens, self.block_size) - len(table.block_ids))

    def blocks_needed(self, seq_id: int, num_tokens: int, cached_blocks: Sequence[int] = ()) -> int:
        """Free blocks allocate_slots would take for these tokens now: fresh blocks, a
        copy-on-write, revived cached-free hits (a new sequence), or a whole reservation.
        Sequences that share a block each count its copy: an upper bound for a group."""
        table = self.tables.get(seq_id)
        if table is not None:
            return self._new_blocks(table, num_tokens) + self._must_copy(table, num_tokens)
        if self.policy == "reserve-max":
            return self.reserve_blocks
        return self._fresh_blocks(num_tokens, len(cached_blocks)) + self._revived(cached_blocks)

    def _fresh_blocks(self, num_tokens: int, num_hit: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - num_hit)

    def _revived(self, blocks: Sequence[int]) -> int:
        """Cached-free hits leave the free queue when touched, so they cost capacity too
        (a hit's RELEASED entries cost nothing)."""
        return sum(1 for b in blocks if b != RELEASED and self.pool.is_available(b))

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
        self._emit({"type": "cow", "seq": seq_id, "index": i, "src": src, "dst": dst})
        return src, dst

    def _append(self, seq_id: int, table: BlockTable, n: int) -> None:
        if n:
            fresh = [self.pool.allocate() for _ in range(n)]
            table.block_ids.extend(fresh)
            self._emit({"type": "alloc", "seq": seq_id, "blocks": fresh})

    def _emit(self, event: dict) -> None:
        if self.listener is not None:
            self.listener(event)

    def _cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int], verified: int) -> None:
        """Register each newly filled full block among the first `verified` tokens under its
        key (computed once per sequence); a block holding a draft token waits."""
        if not self.enable_prefix_caching:
            return
        full = min(verified, len(token_ids)) // self.block_size
        if full <= table.num_cached_blocks:
            return
        keys = table.hashes.update(token_ids)
        for i in range(table.num_cached_blocks, full):
            b = table.block_ids[i]
            # A block the window released before its tokens were verified here: not this table's to register.
            if b != RELEASED and self.pool.cache(b, keys[i]):
                self._emit({"type": "cache", "block": b})
                if self.tier is not None and self.write_policy == "write_through":
                    self._write_through(b, keys[i])
        table.num_cached_blocks = full

    def _slide(self, seq_id: int, table: BlockTable, first_query: int) -> None:
        """Release the blocks no query from `first_query` on reads (the sliding window):
        their entries become RELEASED; each keeps its hash in the free queue."""
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
        self.window_released += len(gone)
        self._emit({"type": "slide", "seq": seq_id, "index": start, "blocks": gone})

    def fork(self, parent_id: int, child_id: int, num_tokens: int | None = None,
             hashes: BlockHashes | None = None) -> list[tuple[int, int]] | None:
        """Child shares the parent's blocks for its first `num_tokens` tokens (default
        all), each ref +1; `hashes` are the child's keys (default: the parent's, cut at
        num_tokens). Under reserve-max the child gets its own reservation and the filled
        blocks are copied (returned as pairs). None if it does not fit."""
        parent = self.tables[parent_id]
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        n = parent.num_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= parent.num_tokens:
            raise ValueError(f"fork length {n} outside [0, {parent.num_tokens}]")
        if parent.num_released > self.first_window_block(n):
            raise ValueError(f"fork at {n} tokens: the sliding window released keys the child's next query reads")
        B = self.block_size
        k = cdiv(n, B)
        child = BlockTable(B, num_tokens=n, hashes=hashes if hashes is not None else parent.hashes.prefix(n),
                           num_cached_blocks=min(parent.num_cached_blocks, n // B),
                           num_released=min(parent.num_released, k))
        copies: list[tuple[int, int]] = []
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
        self.forks += 1
        self._emit({"type": "fork", "parent": parent_id, "seq": child_id, "blocks": list(child.block_ids),
                    "tokens": n, "shared": self.policy == "paged"})
        return copies

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks, tail first (its tail is the least likely reused)."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            tail_first = table.held[::-1]
            self.pool.release(tail_first)
            if self.listener is not None:
                self.listener({"type": "free", "seq": seq_id, "blocks": tail_first})

    # -- queries -------------------------------------------------------------
    def block_table(self, seq_id: int) -> BlockTable:
        return self.tables[seq_id]

    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether num_seqs sequences of num_tokens each fit the empty pool, unshared."""
        return self.shape.can_ever_fit(num_tokens, num_seqs)

    def reset_prefix_cache(self) -> int:
        dropped = self.pool.reset_cache()
        if self.listener is not None:
            self.listener({"type": "reset_cache"})
        return dropped

    def stats(self, walk: bool = True) -> KVStats:
        """The pool's figures. Counters are kept as blocks move, so walk=False costs O(1);
        the slot figures (used slots, eta, blocks without sharing) walk every table, and
        are computed only when asked."""
        pool, B = self.pool, self.block_size
        used = pool.num_used
        used_slots = waste = without_sharing = None
        if walk:
            used_slots, without_sharing = self._walk_slots()
            alloc_slots = used * B
            waste = (alloc_slots - used_slots) / alloc_slots if alloc_slots else 0.0
        return KVStats(
            num_blocks=pool.num_blocks, block_size=B, used_blocks=used,
            cached_free_blocks=pool.num_cached_free, free_blocks=pool.num_available - pool.num_cached_free,
            usage=used / pool.num_blocks, used_slots=used_slots, waste=waste,
            blocks_without_sharing=without_sharing,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
            cow_copies=self.cow_copies, forks=self.forks, evictions=pool.num_evictions,
            shared_blocks=pool.num_shared, prompt_logprob_queries=self.prompt_logprob_queries,
            prompt_logprob_hits=self.prompt_logprob_hits, prompt_logprob_blocks=len(pool.attached),
            window_released=self.window_released, tier_hits=self.tier_hits,
            tier_loaded_blocks=self.tier_loaded_blocks, tier_offloaded_blocks=self.tier_offloaded_blocks,
            tier_backlog=len(self._backlog), swap_outs=self.swap_outs,
            swap_out_blocks=self.swap_out_blocks, tier=self.tier.snapshot() if self.tier is not None else None)

    def _walk_slots(self) -> tuple[int, int]:
        """(slots holding a token, a shared block once; blocks the tables would hold unshared)."""
        B = self.block_size
        fill: dict[int, int] = {}
        without_sharing = 0
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
        return sum(fill.values()), without_sharing

    def check_integrity(self) -> None:
        """Invariants that must hold between any two operations (used by tests and
        debug runs): ref counts equal table references; used, cached-free and free
        partition the pool; the hash map points at the blocks that carry the hashes."""
        refs = [0] * self.pool.num_blocks
        for b, n in self.pins.items():   # the second tier's: a write in flight, a load this step
            assert n > 0, f"block {b}: {n} pins"
            refs[b] += n
        for t in self.tables.values():
            assert all(b == RELEASED for b in t.block_ids[:t.num_released]), "released entries must lead the table"
            for b in t.held:
                assert 0 <= b < self.pool.num_blocks, f"table entry {b} after the released ones"
                refs[b] += 1
            assert t.num_used_blocks <= len(t.block_ids), "table shorter than its tokens"
        cached_free = 0
        for blk in self.pool.blocks:
            assert blk.ref_cnt == refs[blk.block_id], (
                f"block {blk.block_id}: ref {blk.ref_cnt} != {refs[blk.block_id]} holders")
            available = self.pool.is_available(blk.block_id)
            assert available == (blk.ref_cnt == 0), f"block {blk.block_id} free-queue mismatch"
            if blk.block_hash is not None:
                assert self.pool.cached[blk.block_hash] == blk.block_id
                cached_free += available
        assert cached_free == self.pool.num_cached_free
        assert self.pool.num_shared == sum(r > 1 for r in refs), "shared-block count drifted"
        assert len(self.pool.cached) == sum(b.block_hash is not None for b in self.pool.blocks)
        assert self.pool.attached.keys() <= self.pool.cached.keys(), "an entry outlived its block"
