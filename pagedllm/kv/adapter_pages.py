"""LoRA adapters as pages of the KV pool (S-LoRA's unified paging): which blocks hold which
adapter's weights. Plain Python, no torch: the runner writes the weights into the blocks named
here and reads them from there.

An adapter needs `num_pages` blocks (its size in pages: lora.layout says how many). While a
running sequence uses it, its pages are held (ref 1 each, whatever the number of users: the
users are counted here). When the last user leaves, its pages go back to the pool's free
queue *tagged*, as a freed prefix block keeps its hash: an idle adapter stays resident and is
revived by its next user at no cost, until the pool hands one of its pages out again (the LRU
order of the free queue, the same one cold prefix blocks are evicted in). Then the adapter is
gone from the pool, and its other pages are untagged with it.

Tags are negative integers, so they never meet a prefix block's hash (an unsigned xxh3).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from .block_pool import BlockPool

_TAG_SHIFT = 20   # a tag is -(1 + (adapter id << 20) + page index): 2**20 pages an adapter at most


@dataclass(slots=True)
class AdapterFigures:
    resident: int        # adapters whose pages are in the pool (held or idle)
    held: int            # of them, used by running sequences
    held_pages: int      # blocks the held adapters take
    idle_pages: int      # blocks of idle resident adapters (free to take; they count as cached-free)
    loads: int           # adapters written into pages, reloads included
    evictions: int       # idle adapters whose pages were handed out


class AdapterPages:
    def __init__(self, pool: BlockPool, emit: Callable[[dict], None] | None = None) -> None:
        self.pool = pool
        self.pages: dict[int, list[int]] = {}   # resident adapter id -> its blocks, in page order
        self.users: dict[int, int] = {}         # held adapter id -> running sequences using it
        self.idle: OrderedDict[int, None] = OrderedDict()   # resident, unused; least recently used first
        self.pending: dict[int, list[int]] = {}  # placed since take_loads(): the runner must write these
        self.evicted: list[int] = []             # gone since take_loads(): the runner forgets them
        self.num_loads = self.num_evictions = 0
        self._emit = emit or (lambda event: None)

    # -- queries -------------------------------------------------------------
    def cost(self, adapter_id: int, num_pages: int) -> int:
        """Blocks acquire() would take from the free queue now: none for an adapter in use,
        all of its pages otherwise (an idle one's are in the free queue already)."""
        return 0 if adapter_id in self.users else num_pages

    def is_tag(self, key: int) -> bool:
        return key < 0

    def figures(self) -> AdapterFigures:
        held_pages = sum(len(self.pages[a]) for a in self.users)
        idle_pages = sum(len(self.pages[a]) for a in self.idle)
        return AdapterFigures(len(self.pages), len(self.users), held_pages, idle_pages, self.num_loads,
                              self.num_evictions)

    # -- transitions ---------------------------------------------------------
    def acquire(self, adapter_id: int, num_pages: int) -> bool:
        """One more running sequence uses the adapter: its pages are held, placed now if it is
        not resident (the runner then writes it: take_loads). False, changing nothing, if the
        pool has too few blocks to take."""
        if adapter_id in self.users:
            self.users[adapter_id] += 1
            return True
        if num_pages > self.pool.num_available:
            return False
        if adapter_id in self.idle:   # revived as a prefix hit is: its pages leave the free queue
            del self.idle[adapter_id]
            for b in self.pages[adapter_id]:
                self.pool.touch(b)
            self._emit({"type": "adapter_hold", "adapter": adapter_id, "blocks": self.pages[adapter_id]})
        else:
            if not 0 < num_pages <= 1 << _TAG_SHIFT:
                raise ValueError(f"an adapter takes 1 to {1 << _TAG_SHIFT} pages, not {num_pages}")
            blocks = [self.pool.allocate() for _ in range(num_pages)]
            for i, b in enumerate(blocks):
                self.pool.tag(b, self._tag(adapter_id, i))
            self.pages[adapter_id] = self.pending[adapter_id] = blocks
            self.num_loads += 1
            self._emit({"type": "adapter_load", "adapter": adapter_id, "blocks": blocks})
        self.users[adapter_id] = 1
        return True

    def release(self, adapter_id: int) -> None:
        """A running sequence stops using the adapter; the last one leaves it idle, resident."""
        n = self.users[adapter_id] - 1
        if n:
            self.users[adapter_id] = n
            return
        del self.users[adapter_id]
        self.idle[adapter_id] = None
        self.pool.release(self.pages[adapter_id][::-1])   # its first page the last to be handed out
        self._emit({"type": "adapter_idle", "adapter": adapter_id, "blocks": self.pages[adapter_id]})

    def take_loads(self) -> list[tuple[int, list[int]]]:
        """(adapter id, its blocks) placed since the last call, still resident: the runner
        writes their weights before the step's forward."""
        loads, self.pending = list(self.pending.items()), {}
        return loads

    def take_evictions(self) -> list[int]:
        """Adapters evicted since the last call (one placed again since is among take_loads())."""
        gone, self.evicted = self.evicted, []
        return gone

    def on_uncache(self, key: int) -> None:
        """The pool dropped tag `key` (its page handed out, or the cache reset): the adapter is
        no longer resident; its other pages are untagged too, so nothing revives half of it."""
        adapter_id = (-key - 1) >> _TAG_SHIFT
        blocks = self.pages.pop(adapter_id, None)
        if blocks is None:   # a sibling page, untagged below
            return
        assert adapter_id in self.idle, f"adapter {adapter_id} lost a page while in use"
        del self.idle[adapter_id]
        self.pending.pop(adapter_id, None)
        self.evicted.append(adapter_id)
        self.num_evictions += 1
        for b in blocks:
            if self.pool.blocks[b].block_hash is not None and self.pool.blocks[b].block_hash != key:
                self.pool.untag(b)
        self._emit({"type": "adapter_evict", "adapter": adapter_id, "blocks": blocks})

    def count_refs(self, refs: list[int]) -> None:
        """Add the adapters' references to refs[block] (the integrity check)."""
        for a in self.users:
            for b in self.pages[a]:
                refs[b] += 1

    @staticmethod
    def _tag(adapter_id: int, page: int) -> int:
        return -(1 + (adapter_id << _TAG_SHIFT) + page)
