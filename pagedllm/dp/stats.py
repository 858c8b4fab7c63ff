"""The figures of several replicas as one EngineStats: the server's totals.

Counters add up, and stay monotonic across a replica's restart: the front keeps what a dead
replica had counted (`retired`) and adds it to the sums. Gauges add up over the live
replicas; KV usage and waste are recomputed from the summed blocks and slots. Each replica's
second tier (TierStats) adds up the same way: its counters kept, its blocks, bytes and
capacity summed over the live ones.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from ..engine.stats import EngineStats
from ..engine.speculative import SpecStats
from ..kv import KVStats
from ..kv.tier_store import TierStats
from ..structured.compiler import GrammarStats

KV_COUNTERS = ("prefix_queries", "prefix_hits", "cow_copies", "forks", "evictions", "prompt_logprob_queries",
               "prompt_logprob_hits", "window_released", "tier_hits", "tier_loaded_blocks", "tier_offloaded_blocks",
               "swap_outs", "swap_out_blocks")
KV_GAUGES = ("shared_blocks", "prompt_logprob_blocks", "tier_backlog")
TIER_COUNTERS = ("written_blocks", "write_errors", "evicted_blocks", "read_blocks", "read_failures")
ENGINE_COUNTERS = ("preemptions", "prompt_tokens", "computed_prompt_tokens", "generation_tokens", "steps")


def zero_stats(block_size: int, bytes_per_token: int = 0) -> EngineStats:
    kv = KVStats(**{f.name: 0 for f in fields(KVStats)})
    kv = replace(kv, block_size=block_size, usage=0.0, waste=0.0, tier=None)
    return EngineStats(kv, bytes_per_token, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)


def counters_only(s: EngineStats) -> EngineStats:
    """A dead replica's counters, its gauges zeroed: what its restart must not lose."""
    z = replace(zero_stats(s.kv.block_size, s.bytes_per_token), kv_cache_dtype=s.kv_cache_dtype)
    tier = None if s.kv.tier is None else TierStats(**{k: getattr(s.kv.tier, k) for k in TIER_COUNTERS})
    kv = replace(z.kv, tier=tier, **{k: getattr(s.kv, k) for k in KV_COUNTERS})
    return replace(z, kv=kv, spec=s.spec, grammar=s.grammar, **{k: getattr(s, k) for k in ENGINE_COUNTERS})


def sum_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """The sum of several replicas' stats (or of live ones and retired counters)."""
    if not parts:
        raise ValueError("sum_stats needs at least one EngineStats")
    kvs = [p.kv for p in parts]
    B = kvs[0].block_size
    num_blocks, used = sum(k.num_blocks for k in kvs), sum(k.used_blocks for k in kvs)
    walked = all(k.used_slots is not None for k in kvs)  # the slot figures only if every part has them
    used_slots = sum(k.used_slots for k in kvs) if walked else None
    kv = KVStats(
        num_blocks=num_blocks, block_size=B, used_blocks=used,
        cached_free_blocks=sum(k.cached_free_blocks for k in kvs), free_blocks=sum(k.free_blocks for k in kvs),
        usage=used / num_blocks if num_blocks else 0.0, used_slots=used_slots,
        waste=((used * B - used_slots) / (used * B) if used else 0.0) if walked else None,
        blocks_without_sharing=sum(k.blocks_without_sharing for k in kvs) if walked else None,
        tier=tier_total([k.tier for k in kvs]),
        **{k: sum(getattr(x, k) for x in kvs) for k in KV_COUNTERS + KV_GAUGES})
    return EngineStats(
        kv=kv, bytes_per_token=max(p.bytes_per_token for p in parts), kv_cache_dtype=parts[0].kv_cache_dtype,
        peak_used_blocks=sum(p.peak_used_blocks for p in parts), peak_waste=max(p.peak_waste for p in parts),
        num_running=sum(p.num_running for p in parts), num_waiting=sum(p.num_waiting for p in parts),
        spec=SpecStats.total([p.spec for p in parts]), grammar=grammar_total([p.grammar for p in parts]),
        **{k: sum(getattr(p, k) for p in parts) for k in ENGINE_COUNTERS})


def tier_total(parts: Sequence[TierStats | None]) -> TierStats | None:
    """The replicas' tiers as one (None if none has a tier): every field adds up. Replicas
    given one --kv-offload-dir each count the files they know of, so blocks and bytes on a
    shared folder may count a file more than once."""
    tiers = [t for t in parts if t is not None]
    if not tiers:
        return None
    return TierStats(**{f.name: sum(getattr(t, f.name) for t in tiers) for f in fields(TierStats)})


def grammar_total(parts: Sequence[GrammarStats | None]) -> GrammarStats | None:
    if all(p is None for p in parts):
        return None
    total = GrammarStats()
    for p in parts:
        if p is not None:
            total.merge(p)
    return total


@dataclass(frozen=True, slots=True)
class ReplicaFigures:
    """One data-parallel replica as the metrics see it."""
    index: int
    alive: bool
    restarts: int
    routed: int            # requests the router sent it
    stats: EngineStats | None  # None while it restarts
    in_flight: int = 0     # requests sent and not finished
