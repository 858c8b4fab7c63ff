"""The KV report's text: the figures of EngineStats (engine/stats.py) and its KVStats
(kv/stats.py) as `pagedllm generate` prints them after a batch. Each optional part (the
tier, layer groups, adapters, the score cache, speculation) is a line only when it ran."""
from __future__ import annotations

from ..kv import KVStats
from ..kv.groups import STATE
from ..kv_dtype import KV_DTYPES
from .stats import EngineStats


def tier_report(kv: KVStats, tier_dir: str | None = None) -> str:
    """The second tier's line of the KV report (kv: a KVStats with a tier)."""
    c, t = kv.tier, kv.tier.store
    return (f"  tier: {t.blocks} blocks ({t.bytes / 2**20:.1f} MiB of {t.capacity_bytes / 2**30:.1f} GiB)"
            f"{f' in {tier_dir}' if tier_dir else ''}, {c.hits}/{kv.prefix_queries} prompt tokens from the "
            f"tier (tier hit rate {kv.tier_hit_rate:.1%}), loaded {c.loaded_blocks}, offloaded "
            f"{c.offloaded_blocks} (backlog {c.backlog}), evicted {t.evicted_blocks} (tier LRU), swap-outs "
            f"{c.swap_outs} ({c.swap_out_blocks} blocks), read failures {t.read_failures}, "
            f"write errors {t.write_errors}")


def groups_report(kv: KVStats) -> list[str]:
    """A line per KV layer group, for a model whose layers mix attention types."""
    if len(kv.groups) < 2:
        return []
    held = ", ".join(f"{g.kind} {g.held_blocks if g.held_blocks is not None else '?'} held"
                     + (f" ({g.released} snapshots released to the cache)" if g.holds == STATE else
                        f" ({g.released} released)" if g.window else "") for g in kv.groups)
    return [f"  layer groups ({len(kv.groups)}, a block holds one group's layers): {held}"]


def adapters_report(kv: KVStats) -> list[str]:
    """The LoRA adapters' pages in the pool (kv.adapter_pages), when any were placed."""
    a = kv.adapters
    if a is None or not a.loads:
        return []
    return [f"  LoRA adapters in the pool: {a.resident} resident ({a.held} in use: {a.held_pages} blocks; idle: "
            f"{a.idle_pages} blocks, free to take), {a.loads} paged in, {a.evictions} evicted"]


def weights_report(s: EngineStats) -> list[str]:
    """The weights beside the pool: held, and read a token where that is less (a mixture of experts)."""
    if not s.weights_bytes:
        return []
    active = s.active_weights_bytes
    return [f"  weights beside the pool: {s.weights_bytes / 2**30:.2f} GiB held"
            + (f", {active / 2**30:.2f} GiB read a token (its top k experts a layer)" if active != s.weights_bytes
               else "")]


def pool_report(s: EngineStats) -> list[str]:
    """The pool's shape, its peak and now, and the waste at the peak."""
    kv = s.kv
    scales = ", scales included" if KV_DTYPES[s.kv_cache_dtype].quantized else ""
    pool_bytes = kv.num_blocks * (s.bytes_per_block or kv.block_size * s.bytes_per_token)
    formula = f"2*L*d_kv*bytes{scales}"
    if s.expanded_bytes_per_token:
        formula = (f"L*(kv_lora_rank+rope_dim)*bytes: the latent; K/V expanded to full heads would take "
                   f"{s.expanded_bytes_per_token}, {s.expanded_bytes_per_token / s.bytes_per_token:.1f}x more")
    return [
        f"  pool: {kv.num_blocks} blocks x {kv.block_size} tokens, KV {s.kv_cache_dtype}, {s.bytes_per_token} "
        f"bytes/token ({formula}), {s.blocks_per_gib} blocks per GiB, {pool_bytes / 2**20:.0f} MiB",
        f"  peak blocks used: {s.peak_used_blocks} (peak U_kv {s.peak_kv_usage:.1%}); "
        f"now used {kv.used_blocks}, cached-free {kv.cached_free_blocks}, free {kv.free_blocks}",
        f"  waste at peak (allocated slots holding no token): {s.peak_waste:.1%}",
    ]


def scores_report(kv: KVStats) -> list[str]:
    """Prompt logprobs served from beside the cached blocks, when any were asked for."""
    c = kv.scores
    if not c.queries:
        return []
    return [f"  prompt logprobs from the cache: {c.hits}/{c.queries} prompt tokens ({c.hit_rate:.1%}; {c.entries} "
            f"blocks keep theirs, {c.bytes / 2**20:.1f} of {c.cap_bytes / 2**20:.0f} MiB outside the pool, "
            f"{c.dropped} dropped at the cap)"]


def spec_report(s: EngineStats) -> list[str]:
    """Speculative decoding's acceptance, when it ran."""
    if s.spec is None:
        return []
    return [f"  speculative decoding: {s.spec.num_accepted_tokens}/{s.spec.num_draft_tokens} draft tokens accepted "
            f"(acceptance {s.spec.acceptance_rate:.1%}) over {s.spec.num_drafts} verifications, "
            f"{s.spec.mean_accepted_length:.2f} tokens per verifying step; accepted by draft position "
            f"{s.spec.accepted_per_position}"]


def kv_report(stats: EngineStats, tier_dir: str | None = None) -> str:
    """The KV figures `pagedllm generate` prints; `tier_dir`: the --kv-offload-dir it names."""
    s, kv = stats, stats.kv
    prefix = f"  prefix cache: {kv.prefix_hits}/{kv.prefix_queries} prompt tokens hit (H = {kv.hit_rate:.1%})"
    tier = [] if kv.tier is None else [tier_report(kv, tier_dir)]
    counts = [f"  forks {kv.forks}, copy-on-write copies {kv.cow_copies}, evictions {kv.pool.evictions}, "
              f"preemptions {s.preemptions}",
              f"  tokens: {s.prompt_tokens} prompt ({s.computed_prompt_tokens} computed), {s.generation_tokens} "
              f"generated, in {s.steps} steps"]
    return "\n".join(["KV cache report", *pool_report(s), *weights_report(s), prefix, *groups_report(kv),
                      *adapters_report(kv), *tier, *scores_report(kv), *counts, *spec_report(s)])
