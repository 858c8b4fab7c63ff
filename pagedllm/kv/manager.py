"""The KV cache manager: who holds which physical block. Plain Python, no torch.

It speaks in block ids and slot numbers only. Copy-on-write and fork decisions are made
here and returned as (src, dst) block pairs for the model runner to copy.

A coordinator (vLLM v1's KVCacheCoordinator) over one manager per layer group
(single_type.GroupManager: full attention, or a sliding window; kv.groups): every group
draws from the one pool, a step's blocks for all groups are counted before any group takes
one, and a prefix hit is the longest prefix every group can serve. A model of one
attention type has one group, and the manager is the plain paged manager of the paper.
Beside the pool: the prompt logprobs kept with cached blocks (score_store), and a tier
behind a connector (connector.KVConnector), called at a few named points; what a hit
loads from it, over every group, is kv.tier_hit's choice.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..config import ALLOCATION_POLICIES
from .adapter_pages import AdapterPages
from .block_pool import BlockPool
from .block_table import RELEASED, BlockTable
from .connector import KVConnector, StepIO
from .events import KVEvent, KVEventLog
from .groups import KV, STATE
from .hashing import BlockHashes
from .integrity import check
from .pool_shape import PoolShape, window_blocks
from .prefix_hit import PrefixHit
from .score_store import ScoreStore
from .single_type import Copies, GroupManager
from .stats import GroupFigures, KVStats
from .tier_hit import TierHit, load_hit, tier_hit

POLICIES = ALLOCATION_POLICIES


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 policy: str = "paged", max_model_len: int | None = None, sliding_window: int = 0,
                 max_step_tokens: int = 0, connector: KVConnector | None = None,
                 group_windows: Sequence[int] | None = None, score_cache_bytes: int = 1 << 62,
                 group_kinds: Sequence[str] | None = None) -> None:
        """group_windows: each layer group's window (0: full attention; kv.groups); default
        one group windowed by `sliding_window`. group_kinds: what each group's blocks hold
        (kv.groups.KV or STATE; default all KV). Windowed groups release the blocks below their
        windows under the paged policy (reserve-max keeps its reservation).
        max_step_tokens: the most tokens one sequence gets slots for in a step (its chunk and
        lookahead), which bounds what it holds under a window (PoolShape).
        connector: a tier beyond the pool (its scheduler half). score_cache_bytes: the cap on
        prompt logprobs kept beside cached blocks."""
        windows = tuple(group_windows) if group_windows is not None else (sliding_window,)
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if any(w < 0 for w in windows) or not windows:
            raise ValueError(f"sliding windows must be >= 0 (0: full attention), got {windows}")
        if policy not in POLICIES:
            raise ValueError(f"allocation policy must be one of {POLICIES}, got {policy!r}")
        if policy == "reserve-max":
            if max_model_len is None:
                raise ValueError("reserve-max needs max_model_len")
            if len(windows) > 1:
                raise ValueError("reserve-max reserves max_model_len for one block table per sequence: "
                                 "a model with several KV groups needs the paged policy")
            enable_prefix_caching = False  # the traditional scheme has no block sharing, hence no prefix cache
        self.block_size, self.policy, self.enable_prefix_caching = block_size, policy, enable_prefix_caching
        paged = windows if policy == "paged" else (0,)
        bounds = tuple(window_blocks(w, block_size, max_step_tokens) if w and max_step_tokens else 0 for w in paged)
        self.shape = PoolShape.of(num_blocks, block_size, policy, max_model_len, bounds)
        if policy == "reserve-max" and self.shape.reserve_blocks > num_blocks:
            raise ValueError(f"reserve-max needs {self.shape.reserve_blocks} blocks per sequence "
                             f"(max_model_len {max_model_len}) but the pool has {num_blocks}")
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        kinds = tuple(group_kinds) if group_kinds is not None else (KV,) * len(windows)
        if len(kinds) != len(windows) or not set(kinds) <= {KV, STATE}:
            raise ValueError(f"group_kinds {kinds} must name {KV!r} or {STATE!r} for each of {len(windows)} groups")
        self.groups = [GroupManager(i, w, self.pool, block_size, policy, self.shape.reserve_blocks, self._emit, holds)
                       for i, (w, holds) in enumerate(zip(windows, kinds))]
        # State blocks registered in the prefix cache while this step is scheduled: their state is
        # written by this step's forward, after any read of it in the same step (a K/V block's
        # keys are written before any query of the layer reads them), so no hit takes one yet.
        self.in_flight: set[int] = set()
        for g in self.groups:
            if g.holds == STATE:
                g.in_flight = self.in_flight
        # Prompt logprobs kept beside cached blocks, under group 0's keys, within their cap.
        self.scores = ScoreStore(score_cache_bytes if enable_prefix_caching else 0, self.pool.cached.__contains__)
        # LoRA adapters' pages (S-LoRA's unified paging): blocks of the same pool, tagged when idle.
        self.adapters = AdapterPages(self.pool, self._emit)
        self.pool.on_uncache = self._on_uncache
        # Receives every block-level change as a small dict (pagedllm.viz.state says what they
        # mean); events of group g > 0 carry "group": g. None when nobody watches.
        self.listener: Callable[[dict], None] | None = None
        self.prefix_queries = self.prefix_hits = self.forks = 0
        self.events: KVEventLog | None = None   # vLLM's KV events (record_events)
        self.connector = connector
        if connector is not None:  # ValueError if it cannot serve this pool
            connector.bind(self.pool, block_size, self._emit)
            for g in self.groups:
                g.on_cached = connector.on_cached
        self._hook_evictions()

    def watch(self, listener: Callable[[dict], None] | None) -> None:
        """Send every block-level change to `listener` (None: stop)."""
        self.listener = listener
        self._hook_evictions()

    def _hook_evictions(self) -> None:
        """Evictions matter to a listener and to a connector; with neither, they cost nothing."""
        wanted = self.listener is not None or self.connector is not None
        self.pool.on_evict = self._on_evict if wanted else None

    def record_events(self, on: bool = True, salted_token_ids: bool = False) -> None:
        """Keep vLLM's KV events (kv.events) for take_events(); off, they cost nothing.
        salted_token_ids: announce a tenant-salted block's token ids too."""
        self.events = KVEventLog(self.block_size, salted_token_ids) if on and self.enable_prefix_caching else None
        for g in self.groups:
            g.log = self.events

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call, in order."""
        return self.events.take() if self.events is not None else []

    def _on_uncache(self, key: int) -> None:
        if self.adapters.is_tag(key):
            self.adapters.on_uncache(key)
        else:
            self.scores.drop(key)
            if self.events is not None:
                self.events.removed(key)

    def _on_evict(self, block_id: int, key: int) -> None:
        if self.adapters.is_tag(key):   # an idle adapter's page: adapter_evict told them
            return
        if self.connector is not None:
            self.connector.on_evict(block_id, key)
        self._emit({"type": "evict", "block": block_id})

    def _emit(self, event: dict) -> None:
        if self.listener is not None:
            self.listener(event)

    @property
    def tables(self) -> dict[int, BlockTable]:
        """Group 0's tables: every sequence has one, in each group."""
        return self.groups[0].tables

    @property
    def windowed(self) -> bool:
        """Whether any group's queries see only a window (a prefix hit may then lack blocks)."""
        return any(g.window for g in self.groups)

    def block_table(self, seq_id: int, group: int = 0) -> BlockTable:
        return self.groups[group].tables[seq_id]

    def first_window_block(self, first_query: int, group: int = 0) -> int:
        return self.groups[group].first_window_block(first_query)

    # -- a step's tier IO (the connector's) ----------------------------------
    def begin_step(self) -> None:
        """Before a step is scheduled: the state snapshots registered last step are computed now."""
        self.in_flight.clear()
        if self.connector is not None:
            self.connector.begin_step()

    def take_io(self) -> StepIO:
        return self.connector.take_io() if self.connector is not None else ([], [], [])

    def tier_backlog(self) -> int:
        """Write-through blocks held back while the store was behind: an idle step hands them over."""
        return self.connector.figures().backlog if self.connector is not None else 0

    def tier_prefix(self, hashes: BlockHashes, num_tokens: int, hit: Sequence[int]) -> int:
        """Blocks the tier can extend a pool hit `hit` by, of a sequence of `num_tokens` tokens
        (never its last token: that one is computed for its logits)."""
        plan = self.tier_plan(hashes, num_tokens, hit)
        return plan.longest() - plan.start if plan is not None else 0

    def tier_plan(self, hashes: BlockHashes, num_tokens: int, hit: Sequence[int]) -> TierHit | None:
        """Where each group's blocks of the prompt would come from after the pool hit `hit`
        (kv.tier_hit; the store asked once); None without a tier."""
        if self.connector is None:
            return None
        n = (num_tokens - 1) // self.block_size
        hashes = self._hashes(hashes)
        return tier_hit(self.groups, self.connector, [g.keys(hashes, n) for g in self.groups], self._per_group(hit))

    def load_from_tier(self, seq_id: int, hashes: BlockHashes, num_tokens: int, hit: Sequence[int],
                       limit: int, plan: TierHit | None = None, token_ids: Sequence[int] | None = None) -> PrefixHit:
        """A pool hit extended by the longest hit that reads at most `limit` blocks from the tier
        (kv.tier_hit: each group's needed blocks, pool ones pinned, the rest loaded); `plan`:
        tier_plan's answer for this hit, if asked already this step. `token_ids` (the prompt's):
        with KV events on, each block read is announced as it lands in the pool's cache."""
        plan = plan if plan is not None else self.tier_plan(hashes, num_tokens, hit)
        if plan is None or limit <= 0:
            return hit if isinstance(hit, PrefixHit) else PrefixHit(self._per_group(hit))
        blocks = load_hit(plan, self.connector, seq_id, limit)
        if self.events is not None and token_ids is not None:
            fresh = self.connector.fresh_loads()
            for g, src, keys in zip(self.groups, plan.source, plan.keys):
                for i, b in enumerate(src):
                    # under its own key: a source past the hit may name a block a later read reused
                    if b is not None and b in fresh and self.pool.blocks[b].block_hash == keys[i]:
                        g.announce_loaded(hashes, token_ids, i)
        return PrefixHit(blocks)

    def swap_out(self, seq_id: int) -> int:
        """A sequence preempted by swap saves its cached blocks of every group to the tier."""
        if seq_id not in self.tables or self.connector is None:
            return 0
        held = []
        for g in self.groups:
            t = g.tables[seq_id]
            keys = g.keys(t.hashes, t.num_cached_blocks)
            held += [(t.block_ids[i], keys[i]) for i in range(t.num_released, t.num_cached_blocks)
                     if t.block_ids[i] != RELEASED]
        return self.connector.swap_out(seq_id, held)

    def blocks_to_flush(self) -> list[tuple[int, int]]:
        return self.connector.blocks_to_flush() if self.connector is not None else []

    # -- prefix cache --------------------------------------------------------
    def new_hashes(self, salt: str | None = None) -> BlockHashes:
        """Block keys for a new sequence, sized to this pool's blocks."""
        return BlockHashes(self.block_size, salt)

    def lookup_prefix(self, token_ids: Sequence[int], hashes: BlockHashes | None = None) -> PrefixHit:
        """The longest cached full-block prefix every group can serve. It never covers the last
        token: that one must be computed to produce logits. `hashes` are the sequence's own
        keys (computed once, kept across lookups); None hashes unsalted, afresh."""
        if not self.enable_prefix_caching:
            return PrefixHit([[] for _ in self.groups])
        n = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes(hashes)
        hashes.update(token_ids)
        found = [g.cached(g.keys(hashes, n)) for g in self.groups]
        return self.shorten_hit(PrefixHit(found), n)

    def shorten_hit(self, hit: Sequence[int], num_blocks: int) -> PrefixHit:
        """The longest hit of at most num_blocks blocks every group serves among `hit`'s (cached
        blocks, RELEASED where missing). A full group's hit may be cut anywhere; a window
        group's hit of k blocks needs blocks first_window_block(k * B) .. k - 1, which a
        shorter k may lack: so shorten until every group agrees."""
        per_group = hit.per_group if isinstance(hit, PrefixHit) else [list(hit)]
        k = min(num_blocks, *(len(b) for b in per_group))
        while True:
            best = min(g.longest_hit(b, k) for g, b in zip(self.groups, per_group))
            if best == k:
                return PrefixHit([b[:k] for b in per_group])
            k = best

    def _hashes(self, hashes: BlockHashes | None) -> BlockHashes:
        if hashes is None:
            return self.new_hashes()
        if hashes.block_size != self.block_size:
            raise ValueError(f"block hashes of {hashes.block_size}-token blocks used with {self.block_size}-token blocks")
        return hashes

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                       cached_blocks: Sequence[int] = (), hashes: BlockHashes | None = None,
                       lookahead: int = 0, first_query: int | None = None) -> Copies | None:
        """Give sequence `seq_id` slots for its first `num_tokens` tokens, in every group.

        A sequence not yet known starts from `cached_blocks` (a prefix hit) and keeps
        `hashes` (its block keys) for caching its full blocks. `lookahead`: how many of the
        last of those tokens are speculative (drafts, or slots a draft model writes its next
        proposal into), beyond `token_ids`; never cached, kept or taken back by rollback().
        Returns the copy-on-write pairs the runner must copy before writing, or None if the
        pool cannot fit it now, in which case nothing has changed but the window's release.

        `first_query`: the first position whose query runs now (default: the first new
        slot); no later query runs before it, even after a rollback. Windowed groups first
        release the blocks no query from there on reads, fitting or not."""
        tables = [g.tables.get(seq_id) for g in self.groups]
        start = len(cached_blocks) * self.block_size if tables[0] is None else tables[0].num_tokens
        if num_tokens < start:
            raise ValueError(f"num_tokens {num_tokens} < tokens already held {start}")
        first_query = start if first_query is None else first_query
        if not 0 <= first_query <= start:  # the tokens from the first new slot on are computed now
            raise ValueError(f"first_query {first_query} outside [0, {start}]")
        copies: Copies = []
        if tables[0] is None:
            tables = self._admit(seq_id, token_ids, num_tokens, self._per_group(cached_blocks), self._hashes(hashes),
                                 first_query)
            if tables is None:
                return None
        else:
            for g, t in zip(self.groups, tables):
                g.slide(seq_id, t, first_query)  # first: what it releases may serve the growth
            if sum(g.grow_cost(t, num_tokens) for g, t in zip(self.groups, tables)) > self.pool.num_available:
                return None
            for g, t in zip(self.groups, tables):
                copies += g.grow(seq_id, t, num_tokens)
        for t in tables:
            t.num_tokens = num_tokens
        if self.listener is not None:
            ev = {"type": "fill", "seq": seq_id, "tokens": num_tokens}
            if lookahead:  # speculative decoding: the last `lookahead` slots hold unverified drafts
                ev["lookahead"] = lookahead
            self.listener(ev)
        if self.enable_prefix_caching:
            for g, t in zip(self.groups, tables):
                g.cache_full_blocks(t, token_ids, num_tokens - lookahead)
        return copies

    def _per_group(self, hit: Sequence[int]) -> list[list[int]]:
        if isinstance(hit, PrefixHit):
            return hit.per_group
        if hit and len(self.groups) > 1:
            raise ValueError("a prefix hit of a model with several KV groups must come from lookup_prefix")
        return [list(hit) for _ in self.groups]

    def _admit(self, seq_id: int, token_ids: Sequence[int], num_tokens: int, hits: list[list[int]],
               hashes: BlockHashes, first_query: int) -> list[BlockTable] | None:
        """Tables for a new sequence in every group, or None (changing nothing) if they do not
        fit. Every group takes its hit before any takes a fresh block."""
        if sum(g.admit_cost(num_tokens, h, first_query) for g, h in zip(self.groups, hits)) > self.pool.num_available:
            return None
        tables = [g.admit(seq_id, h, hashes, first_query, len(token_ids)) for g, h in zip(self.groups, hits)]
        if tables[0] is None:  # reserve-max (one group): free blocks, but no contiguous run
            return None
        for g, t in zip(self.groups, tables):
            g.extend(seq_id, t, num_tokens)
        if self.enable_prefix_caching:
            hit = len(hits[0]) * self.block_size
            self.prefix_queries += len(token_ids)
            self.prefix_hits += hit
            if self.connector is not None:
                for g, t in zip(self.groups, tables):
                    self.connector.loaded_in(t.held, count=g is self.groups[0])
                if self.events is not None:   # a hit the tier loaded is hittable here now
                    for g, t, h in zip(self.groups, tables, hits):
                        g.announce(t, token_ids, 0, len(h))
        return tables

    def blocks_needed(self, seq_id: int, num_tokens: int, cached_blocks: Sequence[int] = ()) -> int:
        """Free blocks allocate_slots would take for these tokens now, over every group: fresh
        blocks, a copy-on-write, revived cached-free hits (a new sequence), or a whole
        reservation. Sequences that share a block each count its copy: an upper bound for a group."""
        if seq_id in self.tables:
            return sum(g.grow_cost(g.tables[seq_id], num_tokens) for g in self.groups)
        hits = self._per_group(cached_blocks)
        first = len(hits[0]) * self.block_size
        return sum(g.admit_cost(num_tokens, h, first) for g, h in zip(self.groups, hits))

    def rollback(self, seq_id: int, num_tokens: int, token_ids: Sequence[int], lookahead: int = 0) -> list[int]:
        """After verification: keep the first `num_tokens` slots (the tokens whose KV is now
        right) and `lookahead` unverified slots past them, give back the blocks only rejected
        drafts filled, and register the full blocks among the kept tokens (`token_ids`: at
        least those tokens). A block is never cached from an unverified token. Returns the
        blocks freed."""
        table = self.tables[seq_id]
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"rollback to {num_tokens} tokens outside [0, {table.num_tokens}]")
        if len(token_ids) < num_tokens:
            raise ValueError(f"rollback: {len(token_ids)} token ids for {num_tokens} kept tokens")
        held = min(table.num_tokens, num_tokens + max(0, lookahead))
        for g in self.groups:   # every group checked before any rolls back
            g.check_rollback(g.tables[seq_id], num_tokens, held)
        return [b for g in self.groups for b in g.rollback(seq_id, num_tokens, held, token_ids)]

    def fork(self, parent_id: int, child_id: int, num_tokens: int | None = None,
             hashes: BlockHashes | None = None) -> Copies | None:
        """Child shares the parent's blocks for its first `num_tokens` tokens (default all),
        each ref +1, in every group; `hashes` are the child's keys (default: the parent's, cut
        at num_tokens). Under reserve-max the child gets its own reservation and the filled
        blocks are copied (returned as pairs). None if it does not fit."""
        parent = self.tables[parent_id]
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        n = parent.num_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= parent.num_tokens:
            raise ValueError(f"fork length {n} outside [0, {parent.num_tokens}]")
        for g in self.groups:  # checked in every group before any forks
            g.check_fork(g.tables[parent_id], n)
        hashes = hashes if hashes is not None else parent.hashes.prefix(n)
        copies: Copies = []
        for g in self.groups:
            more = g.fork(parent_id, child_id, n, hashes)
            if more is None:   # reserve-max, one group: nothing was taken
                return None
            copies += more
        self.forks += 1
        return copies

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks in every group, tail first."""
        for g in self.groups:
            g.free(seq_id)

    # -- queries -------------------------------------------------------------
    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether num_seqs sequences of num_tokens each fit the empty pool, unshared."""
        return self.shape.can_ever_fit(num_tokens, num_seqs)

    def reset_prefix_cache(self) -> int:
        if self.events is not None:   # one event, not a removal per block
            self.events.cleared()
        dropped = self.pool.reset_cache()
        self._emit({"type": "reset_cache"})
        return dropped

    def stats(self, walk: bool = True) -> KVStats:
        """The figures, each part from its owner. Counters are kept as blocks move, so
        walk=False costs O(groups); the slot figures (used slots, eta, blocks without sharing,
        each group's held blocks) walk every table, and are computed only when asked."""
        held: list[int | None] = [None] * len(self.groups)
        fill: dict[int, int] = {}   # block -> slots holding a token (a block is one group's)
        without_sharing = state_blocks = 0
        if walk:
            for i, g in enumerate(self.groups):
                if g.holds == STATE:   # a state block holds no token slots: outside eta
                    held[i] = len({b for t in g.tables.values() for b in t.held})
                    state_blocks += held[i]
                    continue
                before = len(fill)
                without_sharing += g.walk_slots(fill)
                held[i] = len(fill) - before   # every block a table holds enters `fill` once
        s = KVStats(self.block_size, self.pool.figures(),
                    [GroupFigures(g.window, n, g.released, g.holds) for g, n in zip(self.groups, held)],
                    self.scores.figures(), self.prefix_queries, self.prefix_hits,
                    sum(g.cow_copies for g in self.groups), self.forks,
                    tier=self.connector.figures() if self.connector is not None else None,
                    adapters=self.adapters.figures())
        if walk:
            s.blocks_without_sharing, s.used_slots = without_sharing, sum(fill.values())
            # eta is over KV blocks: an adapter's pages hold weights, a state block a state, not token slots
            alloc_slots = (s.pool.used_blocks - s.adapters.held_pages - state_blocks) * self.block_size
            s.waste = (alloc_slots - s.used_slots) / alloc_slots if alloc_slots else 0.0
        return s

    def check_integrity(self) -> None:
        """The invariants that hold between any two operations (integrity.check)."""
        check(self)
