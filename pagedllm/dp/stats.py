"""The figures of several replicas as one EngineStats: the server's totals.

Counters add up, and stay monotonic across a replica's restart: the front keeps what a dead
replica had counted (`retired`) and adds it to the sums. Gauges add up over the live
replicas; KV usage and waste are recomputed from the summed blocks and slots (kv.stats adds
the KV parts up, each its own way). Each replica's second tier adds up the same way: its
counters kept, its blocks, bytes and capacity summed over the live ones.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..engine.stats import EngineStats
from ..engine.speculative import SpecStats
from ..kv.stats import counters_of, empty_stats, kv_total
from ..structured.compiler import GrammarStats

ENGINE_COUNTERS = ("preemptions", "prompt_tokens", "computed_prompt_tokens", "generation_tokens", "steps")


def zero_stats(block_size: int, bytes_per_token: int = 0, windows: Sequence[int] = (0,)) -> EngineStats:
    return EngineStats(empty_stats(block_size, windows), bytes_per_token, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)


def counters_only(s: EngineStats) -> EngineStats:
    """A dead replica's counters, its gauges zeroed: what its restart must not lose."""
    z = replace(zero_stats(s.kv.block_size, s.bytes_per_token), kv_cache_dtype=s.kv_cache_dtype)
    return replace(z, kv=counters_of(s.kv), spec=s.spec, grammar=s.grammar,
                   **{k: getattr(s, k) for k in ENGINE_COUNTERS})


def sum_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """The sum of several replicas' stats (or of live ones and retired counters)."""
    if not parts:
        raise ValueError("sum_stats needs at least one EngineStats")
    return EngineStats(
        kv=kv_total([p.kv for p in parts]), bytes_per_token=max(p.bytes_per_token for p in parts),
        kv_cache_dtype=parts[0].kv_cache_dtype, bytes_per_block=max(p.bytes_per_block for p in parts),
        peak_used_blocks=sum(p.peak_used_blocks for p in parts), peak_waste=max(p.peak_waste for p in parts),
        num_running=sum(p.num_running for p in parts), num_waiting=sum(p.num_waiting for p in parts),
        spec=SpecStats.total([p.spec for p in parts]), grammar=grammar_total([p.grammar for p in parts]),
        weights_bytes=sum(p.weights_bytes for p in parts), active_weights_bytes=max(p.active_weights_bytes for p in parts),
        **{k: sum(getattr(p, k) for p in parts) for k in ENGINE_COUNTERS})


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
