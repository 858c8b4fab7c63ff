"""KV connectors: a tier beyond the pool, in two halves (vLLM v1's KVConnector roles).

The scheduler half (KVConnector, here, no torch) decides: which cached blocks go to the
tier and when, what a prefix hit can load from it, which blocks stay pinned while bytes
move. It speaks in block ids and keys, and hands each step's IO to the plan. The worker
half (ConnectorWorker, in the runner) moves the bytes between the pool's tensors and the
store. The KV manager calls the scheduler half at a few named points (a block cached, a
cached block evicted, a step begun, a hit extended, a sequence swapped out) and knows
nothing else of it.

OffloadConnector is the one implementation: the prefix cache's full blocks copied to a
BlockStore (on disk, tier_store.TierStore; shared on Redis / Valkey, redis_store.RedisStore)
under their chained keys. A new store needs no change here or in the manager.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ..config import OFFLOAD_WRITE_POLICIES
from .block_pool import BlockPool
from .block_store import TierStats

# A step's IO, in this order (the runner's): `saves` (block, key): copy the block's bytes now,
# then write (it is about to be reused); `loads` (block, payload): the store's verified bytes
# into a fresh block before the forward reads it; after the forward, `writes` (block, key):
# write the block in place (pinned until written).
StepIO = tuple[list[tuple[int, int]], list[tuple[int, object]], list[tuple[int, int]]]


class BlockStore(Protocol):
    """Blocks' bytes under 64-bit keys, beyond the pool (tier_store.TierStore is one)."""
    block_bytes: int

    def __contains__(self, key: int) -> bool: ...
    def have(self, keys: Sequence[int]) -> set[int]: ...
    def read(self, key: int) -> object | None: ...
    def read_many(self, keys: Sequence[int]) -> list[object | None]: ...
    def put(self, key: int, parts: Sequence) -> None: ...
    def take_done(self) -> list[tuple[int, bool]]: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def snapshot(self) -> TierStats: ...


class ConnectorWorker(ABC):
    """The worker half: a step's IO carried out on the runner's pools."""

    @abstractmethod
    def before_forward(self, saves: list[tuple[int, int]], loads: list[tuple[int, object]]) -> None:
        """Saves first (their blocks may be a load's or a copy's destination this step), then loads."""

    @abstractmethod
    def after_forward(self, writes: list[tuple[int, int]]) -> None:
        """The blocks written this step, to the store, in place."""

    @abstractmethod
    def flush(self, pairs: list[tuple[int, int]]) -> None:
        """Write these (block, key) now and wait for them (a clean shutdown)."""


@dataclass(slots=True)
class TierFigures:
    """A tier's counters, kept by its connector, and its store's own."""
    write_policy: str = "write_through"
    hits: int = 0                # prefix-hit tokens whose blocks were loaded from it (part of the pool's hits)
    loaded_blocks: int = 0
    offloaded_blocks: int = 0    # blocks handed to it (write-through, write-back, swap)
    backlog: int = 0             # write-through blocks waiting for the store to catch up
    swap_outs: int = 0           # sequences preempted by swap
    swap_out_blocks: int = 0     # the blocks they saved
    store: TierStats = field(default_factory=TierStats)


class KVConnector(ABC):
    """The scheduler half of a tier, as the KV manager calls it."""
    pins: dict[int, int]          # block -> references the connector holds (no table does)

    def bind(self, pool: BlockPool, block_size: int, emit: Callable[[dict], None]) -> None:
        """Serve this pool; ValueError if it cannot."""
        if not pool.enable_caching:
            raise ValueError("the KV tier (kv_offload_dir, kv_offload_url) needs the prefix cache (its blocks are "
                             "kept under their hashes): drop --no-enable-prefix-caching or the tier")
        self.pool, self.block_size, self.emit = pool, block_size, emit

    def begin_step(self) -> None:
        """Before a step is scheduled."""

    def on_cached(self, block_id: int, key: int) -> None:
        """A full block was registered in the prefix cache under `key`."""

    def on_evict(self, block_id: int, key: int) -> None:
        """A cached-free block is about to be reused: its bytes are still there."""

    @abstractmethod
    def have(self, keys: Sequence[int]) -> set[int]:
        """Which of these keys the tier holds (one question to the store)."""

    @abstractmethod
    def pin_for_step(self, blocks: Sequence[int]) -> None:
        """Keep these pool blocks (a hit's) as they are until the next step: a load's fresh
        block must never evict one of them."""

    @abstractmethod
    def load_blocks(self, seq_id: int, wanted: Sequence[tuple[int, int, int]]) -> list[int]:
        """For each (key, index, group) in order, a fresh block registered under the key, its bytes
        read from the tier (copied in before the forward), pinned for this step; up to the first
        the store cannot serve or the pool has no room for (one block is always left): the
        blocks loaded, one per entry before it. `index`, `group`: where the sequence's table takes
        each (events)."""

    def fresh_loads(self) -> set[int]:
        """Blocks read from the tier that no admission has taken yet."""
        return set()

    def loaded_in(self, blocks: Sequence[int], count: bool = True) -> None:
        """A hit took these blocks: those loaded for it count as tier hits (once; `count`:
        they hold tokens, a state block does not)."""

    def swap_out(self, seq_id: int, blocks: Sequence[tuple[int, int]]) -> int:
        """A sequence preempted by swap: of its cached (block, key), save those the tier lacks
        and no other table holds; returns how many."""
        return 0

    @abstractmethod
    def take_io(self) -> StepIO:
        """This step's (saves, loads, writes) for the runner; the lists start anew."""

    def blocks_to_flush(self) -> list[tuple[int, int]]:
        """(block, key) to write at a clean shutdown."""
        return []

    @abstractmethod
    def figures(self) -> TierFigures: ...

    def close(self) -> None:
        """Finish the store's writes."""


class OffloadConnector(KVConnector):
    """The prefix cache's full blocks kept in a BlockStore too, written through as they are
    cached (pinned, read in place, never copied) or back as they are evicted."""

    def __init__(self, store: BlockStore, write_policy: str = "write_through") -> None:
        if write_policy not in OFFLOAD_WRITE_POLICIES:
            raise ValueError(f"kv_offload_write_policy must be one of {OFFLOAD_WRITE_POLICIES}, got {write_policy!r}")
        self.store, self.write_policy = store, write_policy
        self.pins = {}
        self._writing: dict[int, int] = {}    # key -> block id, written in place (pinned)
        # Write-through blocks beyond max_inflight, oldest first (key -> block id): written as the
        # store catches up, or saved when the pool evicts them before that.
        self._backlog: dict[int, int] = {}
        self._load_pins: list[int] = []
        self._fresh_loads: set[int] = set()   # loaded blocks no admission has hit yet
        self.saves: list[tuple[int, int]] = []
        self.loads: list[tuple[int, object]] = []
        self.writes: list[tuple[int, int]] = []
        self.hits = self.loaded_blocks = self.offloaded_blocks = self.swap_outs = self.swap_out_blocks = 0

    def bind(self, pool: BlockPool, block_size: int, emit: Callable[[dict], None]) -> None:
        super().bind(pool, block_size, emit)
        # Writes in place pin their blocks: at most a quarter of the pool waits on the store.
        self.max_inflight = max(1, pool.num_blocks // 4)

    # -- pins ----------------------------------------------------------------
    def _pin(self, blocks: list[int]) -> None:
        """A reference that no table holds: the block stays as it is until unpinned."""
        for b in blocks:
            self.pool.touch(b)
            self.pins[b] = self.pins.get(b, 0) + 1
        if blocks:
            self.emit({"type": "pin", "blocks": list(blocks)})

    def _unpin(self, blocks: list[int]) -> None:
        for b in blocks:
            n = self.pins.pop(b) - 1
            if n:
                self.pins[b] = n
        self.pool.release(blocks)
        if blocks:
            self.emit({"type": "unpin", "blocks": list(blocks)})

    # -- writes --------------------------------------------------------------
    def _save(self, block_id: int, key: int) -> None:
        self.saves.append((block_id, key))
        self.offloaded_blocks += 1

    def _write_through(self, block_id: int, key: int) -> None:
        if key in self.store or key in self._writing:
            return
        if len(self._writing) >= self.max_inflight:  # the store is behind: keep the pool for the batch
            self._backlog[key] = block_id
            return
        self._pin([block_id])
        self._writing[key] = block_id
        self.writes.append((block_id, key))
        self.offloaded_blocks += 1

    def on_cached(self, block_id: int, key: int) -> None:
        if self.write_policy == "write_through":
            self._write_through(block_id, key)

    def on_evict(self, block_id: int, key: int) -> None:
        """The store gets an evicted block first if it lacks it and wants it (write-back; write-
        through: one still waiting in the backlog)."""
        self._fresh_loads.discard(block_id)
        queued = self._backlog.pop(key, None) is not None
        if (queued or self.write_policy == "write_back") and key not in self.store:
            self._save(block_id, key)

    def begin_step(self) -> None:
        """Last step's loads are in their blocks, and the writes finished since give their
        blocks back."""
        self._unpin(self._load_pins)
        self._load_pins = []
        written = [self._writing.pop(key) for key, _ in self.store.take_done() if key in self._writing]
        self._unpin(written)
        while self._backlog and len(self._writing) < self.max_inflight:
            key = next(iter(self._backlog))
            b = self._backlog.pop(key)
            if self.pool.blocks[b].block_hash == key:
                self._write_through(b, key)

    def take_io(self) -> StepIO:
        io = self.saves, self.loads, self.writes
        if self.saves or self.writes:
            self.emit({"type": "offload", "blocks": [b for b, _ in self.saves + self.writes]})
        self.saves, self.loads, self.writes = [], [], []
        return io

    # -- reads ---------------------------------------------------------------
    def have(self, keys: Sequence[int]) -> set[int]:
        return self.store.have(keys) if keys else set()

    def pin_for_step(self, blocks: Sequence[int]) -> None:
        self._pin(list(blocks))
        self._load_pins += blocks

    def load_blocks(self, seq_id: int, wanted: Sequence[tuple[int, int, int]]) -> list[int]:
        """The blocks' bytes asked for in one request to the store (a networked store: a round
        trip for many of a hit's blocks, not one each), each verified before its block is taken;
        the runner copies them in before the forward."""
        room = max(self.pool.num_available - 1, 0)
        loaded = []
        for (key, index, group), payload in zip(wanted, self.store.read_many([key for key, _, _ in wanted[:room]])):
            if payload is None:
                break
            loaded.append(self._take(seq_id, key, index, group, payload))
        return loaded

    def _take(self, seq_id: int, key: int, index: int, group: int, payload: object) -> int:
        """A fresh block for a verified payload."""
        b = self.pool.allocate()
        self.pool.cache(b, key)
        self.pins[b] = self.pins.get(b, 0) + 1   # allocate() gave it its one reference
        self._fresh_loads.add(b)
        self.loads.append((b, payload))
        self.loaded_blocks += 1
        ev = {"type": "tier_load", "seq": seq_id, "block": b, "index": index}
        if group:
            ev["group"] = group
        self.emit(ev)
        self._load_pins.append(b)
        return b

    def fresh_loads(self) -> set[int]:
        return self._fresh_loads

    def loaded_in(self, blocks: Sequence[int], count: bool = True) -> None:
        if self._fresh_loads:
            loaded = self._fresh_loads.intersection(blocks)
            self._fresh_loads -= loaded
            if count:
                self.hits += len(loaded) * self.block_size

    def swap_out(self, seq_id: int, blocks: Sequence[tuple[int, int]]) -> int:
        """A sequence preempted by swap: its full blocks that the store lacks and no other
        table holds are saved before they can be reused; it resumes through a prefix hit
        (pool, else tier). Its partial last block (fewer than B tokens) is recomputed."""
        saved = []
        for b, key in blocks:
            # A block another table holds stays in the pool; if it leaves later, the store gets it
            # then (write-back saves at eviction; write-through has written it, or its backlog does).
            if key not in self.store and key not in self._writing and self.pool.blocks[b].ref_cnt == 1:
                self._save(b, key)
                saved.append(b)
        self.swap_outs += 1
        self.swap_out_blocks += len(saved)
        self.emit({"type": "swap_out", "seq": seq_id, "blocks": saved})
        return len(saved)

    def blocks_to_flush(self) -> list[tuple[int, int]]:
        """Every cached block the store lacks (write-back: all it kept; write-through: its backlog)."""
        return [(b, key) for key, b in self.pool.cached.items()
                if key >= 0 and key not in self.store and key not in self._writing]   # < 0: an adapter's page

    def figures(self) -> TierFigures:
        return TierFigures(self.write_policy, self.hits, self.loaded_blocks, self.offloaded_blocks,
                           len(self._backlog), self.swap_outs, self.swap_out_blocks, self.store.snapshot())

    def close(self) -> None:
        self.store.close()
