"""KVStats: the memory manager's figures, each part built by the object that owns it (the
pool, each layer group, the score store, the connector) and put together by the manager.

Parts add up across data-parallel replicas (`total`): every integer field is a count or a
gauge that sums; ratios are properties, recomputed from the sums."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence, TypeVar

from .adapter_pages import AdapterFigures
from .block_pool import PoolFigures
from .connector import TierFigures
from .groups import KV, group_kind
from .score_store import ScoreFigures
from .block_store import TierStats

T = TypeVar("T")


@dataclass(slots=True)
class GroupFigures:
    """One layer group (kv.groups): its attention, its layers, what its tables hold."""
    window: int                   # 0: full attention
    held_blocks: int | None       # distinct blocks its tables hold (None in a stats(walk=False) snapshot)
    released: int                 # blocks its window released from tables (0 for full attention)
    holds: str = KV               # KV, or STATE: a recurrent state per sequence (kv.groups)

    @property
    def kind(self) -> str:
        return group_kind(self.window, self.holds)


@dataclass(slots=True)
class KVStats:
    block_size: int
    pool: PoolFigures
    groups: list[GroupFigures]
    scores: ScoreFigures          # prompt logprobs kept beside cached blocks
    prefix_queries: int = 0       # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0          # prompt tokens served from it (the tier's loads included)
    cow_copies: int = 0
    forks: int = 0
    # The figures that walk every block table (None in a stats(walk=False) snapshot):
    used_slots: int | None = None               # slots that hold a token (a shared block counts once)
    waste: float | None = None                  # eta: (allocated - used) / allocated slots
    blocks_without_sharing: int | None = None   # blocks the tables would hold with no sharing
    tier: TierFigures | None = None             # the second tier's, when there is one
    adapters: AdapterFigures | None = None      # LoRA adapters' pages in the pool (kv.adapter_pages)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def used_blocks(self) -> int:
        return self.pool.used_blocks

    @property
    def cached_free_blocks(self) -> int:
        return self.pool.cached_free_blocks

    @property
    def free_blocks(self) -> int:
        return self.pool.free_blocks

    @property
    def usage(self) -> float:
        """U_kv: allocated blocks / all blocks."""
        return self.pool.usage

    @property
    def window_released(self) -> int:
        return sum(g.released for g in self.groups)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def tier_hit_rate(self) -> float:
        """Share of the prompt tokens looked up that the tier served."""
        return self.tier.hits / self.prefix_queries if self.tier is not None and self.prefix_queries else 0.0

    def as_dict(self) -> dict:
        from dataclasses import asdict
        d = asdict(self)
        d.update(num_blocks=self.num_blocks, usage=self.usage, hit_rate=self.hit_rate,
                 tier_hit_rate=self.tier_hit_rate, window_released=self.window_released)
        return d


def add(parts: Sequence[T]) -> T:
    """Field by field sum of dataclasses of one kind: numbers add up (None if any part lacks
    one: a figure not walked); strings and nested parts are the first part's."""
    def num(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    first, out = parts[0], {}
    for f in fields(first):
        vals = [getattr(p, f.name) for p in parts]
        if all(num(v) for v in vals):
            out[f.name] = sum(vals)
        elif any(num(v) for v in vals) and all(v is None or num(v) for v in vals):
            out[f.name] = None
    return replace(first, **out)


def tier_total(parts: Sequence[TierFigures | None]) -> TierFigures | None:
    """Several tiers as one (None if none has one): counters and the stores' figures add up."""
    tiers = [t for t in parts if t is not None]
    if not tiers:
        return None
    return replace(add(tiers), store=add([t.store for t in tiers]))


def kv_total(parts: Sequence[KVStats]) -> KVStats:
    """Several replicas' KV figures as one pool's: counts and gauges add, ratios follow."""
    B = parts[0].block_size
    walked = all(p.used_slots is not None for p in parts)  # the slot figures only if every part has them
    used_slots = sum(p.used_slots for p in parts) if walked else None
    used = sum(p.pool.used_blocks for p in parts)
    # Group by group (a retired replica's counters may carry fewer: a front's zeros have one).
    per_group = [[p.groups[i] for p in parts if i < len(p.groups)] for i in range(max(len(p.groups) for p in parts))]
    groups = [replace(add(gs), window=gs[0].window, held_blocks=sum(g.held_blocks for g in gs)
                      if all(g.held_blocks is not None for g in gs) else None) for gs in per_group]
    return KVStats(
        B, add([p.pool for p in parts]), groups, add([p.scores for p in parts]),
        *(sum(getattr(p, n) for p in parts) for n in ("prefix_queries", "prefix_hits", "cow_copies", "forks")),
        used_slots=used_slots, waste=((used * B - used_slots) / (used * B) if used else 0.0) if walked else None,
        blocks_without_sharing=sum(p.blocks_without_sharing for p in parts) if walked else None,
        tier=tier_total([p.tier for p in parts]))


def counters_of(s: KVStats) -> KVStats:
    """A stopped replica's counters, its gauges zeroed: what a restart must not lose."""
    zero_pool = PoolFigures(0, 0, 0, 0, 0, s.pool.evictions)
    groups = [GroupFigures(g.window, 0, g.released, g.holds) for g in s.groups]
    sc = s.scores
    scores = ScoreFigures(sc.queries, sc.hits, 0, 0, 0, sc.dropped)
    tier = None
    if s.tier is not None:
        t = s.tier
        store = TierStats(0, 0, 0, t.store.written_blocks, t.store.write_errors, t.store.evicted_blocks,
                          t.store.read_blocks, t.store.read_failures)
        tier = TierFigures(t.write_policy, t.hits, t.loaded_blocks, t.offloaded_blocks, 0, t.swap_outs,
                           t.swap_out_blocks, store)
    return KVStats(s.block_size, zero_pool, groups, scores, s.prefix_queries, s.prefix_hits, s.cow_copies, s.forks,
                   0, 0.0, 0, tier)


def empty_stats(block_size: int, windows: Sequence[int] = (0,)) -> KVStats:
    """No pool at all (a front with no live replica)."""
    return KVStats(block_size, PoolFigures(0, 0, 0, 0, 0, 0), [GroupFigures(w, 0, 0) for w in windows],
                   ScoreFigures(), used_slots=0, waste=0.0, blocks_without_sharing=0)
