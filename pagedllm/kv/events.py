"""What the prefix cache tells the world: which blocks it holds, as vLLM's KV events.

A KV-aware router (llm-d, Dynamo, vllm-router, the SGLang gateway's cache-aware policy)
keeps an index of which replica holds which block and routes a prompt to the replica whose
cache covers most of it. It learns that index from these events. They are vLLM's
(`vllm.distributed.kv_events`), kept here as plain data:

- BlockStored: full blocks became hittable, as one run of a sequence (each block's chained
  key, the key before the run's first block, the run's token ids);
- BlockRemoved: blocks left the cache (evicted for reuse);
- AllBlocksCleared: the whole cache was reset.

A block is announced when it becomes hittable under a sequence whose tokens are known: when
it is computed and registered (cache_full_blocks), or when a sequence is admitted over a
hit that the tier loaded. It is removed only if it was announced, so a listener's index
never holds a block it cannot match, nor misses one the cache serves. Keys are the pool's:
chained over the tenant's cache salt, xor the layer group's salt (groups > 0).

The engine drains the log after each step and hands it to a publisher (engine.kv_events);
recording costs nothing while no publisher is configured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventLog:
    """The events since the last take(), and the keys announced so far (key -> group).
    salted_token_ids False: a block under a tenant's cache salt is announced without its
    token ids (its keys still), so a subscriber never reads a tenant's prompt; a router
    matching tokens could not match salted keys anyway."""
    block_size: int
    salted_token_ids: bool = False
    events: list[KVEvent] = field(default_factory=list)
    announced: dict[int, int] = field(default_factory=dict)

    def stored(self, group: int, keys: Sequence[int], parent: int | None, token_ids: Sequence[int],
               salted: bool = False) -> None:
        """A run of consecutive blocks (keys[i] holds token_ids[i*B:(i+1)*B]); those already
        announced are left out, splitting the run where they sit. `salted`: under a tenant's
        cache salt (its token ids are left out unless salted_token_ids)."""
        if salted and not self.salted_token_ids:
            token_ids = ()
        run: list[int] = []
        first = 0
        for i, key in enumerate(keys):
            if key in self.announced:
                self._flush(group, run, first, parent, keys, token_ids)
                run, first = [], i + 1
                continue
            self.announced[key] = group
            run.append(key)
        self._flush(group, run, first, parent, keys, token_ids)

    def _flush(self, group: int, run: list[int], first: int, parent: int | None, keys: Sequence[int],
               token_ids: Sequence[int]) -> None:
        if run:
            B = self.block_size
            before = keys[first - 1] if first else parent
            tokens = list(token_ids[first * B:(first + len(run)) * B]) if token_ids else []
            self.events.append(BlockStored(list(run), before, tokens, B, group))

    def removed(self, key: int) -> None:
        group = self.announced.pop(key, None)
        if group is not None:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved) and last.group_idx == group:   # an eviction burst: one event
                last.block_hashes.append(key)
            else:
                self.events.append(BlockRemoved([key], group))

    def cleared(self) -> None:
        self.announced.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
