"""Prometheus metrics with vLLM v1's names, types, buckets and meanings (vllm/v1/metrics/loggers.py),
under a configurable prefix: `pagedllm:` by default, `vllm:` so vLLM's Grafana dashboards work unchanged.

Everything is observed on the engine thread (AsyncLLMEngine's observer), not in the HTTP handlers:
a request aborted because its client left never reaches a handler again, and must still be counted.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.stats import EngineStats
from ..kv import TierFigures
from ..outputs import RequestOutput

if TYPE_CHECKING:
    from ..dp.stats import ReplicaFigures
    from ..engine.client import EngineClient

# vLLM v1's buckets, so dashboards' quantiles mean the same thing.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(upper: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `upper` (vLLM's build_1_2_5_buckets for token counts)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > upper:
                return out
            out.append(v)
        exp += 1


def engine_rows(s: EngineStats) -> list[tuple[type, str, str, float]]:
    """(family kind, name, help, value) of every engine figure: the totals' and each replica's."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    return [
        (g, "num_requests_running", "Requests with a sequence in the running batch.", s.num_running),
        (g, "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
        (g, "kv_cache_usage_perc", "KV-cache usage: fraction of blocks held by requests (1 = full).", s.kv.usage),
        (c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.kv.prefix_queries),
        (c, "prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.kv.prefix_hits),
        # Ours: prompt logprobs kept beside cached blocks, counted apart from the KV hits above.
        (c, "prompt_logprobs_cache_queries", "Prompt tokens of prompt-logprob requests whose logprobs were looked up "
         "in the prefix cache.", s.kv.scores.queries),
        (c, "prompt_logprobs_cache_hits", "Prompt tokens whose logprobs came from the prefix cache, not recomputed.",
         s.kv.scores.hits),
        (g, "prompt_logprobs_cache_blocks", "Cached KV blocks that keep their tokens' prompt logprobs beside them.",
         s.kv.scores.entries),
        (g, "prompt_logprobs_cache_bytes", "Bytes of prompt logprobs kept beside cached blocks (outside the KV "
         "pool).", s.kv.scores.bytes),
        (g, "prompt_logprobs_cache_capacity_bytes", "Most bytes of prompt logprobs kept "
         "(--prompt-logprobs-cache-memory).", s.kv.scores.cap_bytes),
        (c, "prompt_logprobs_cache_dropped", "Kept prompt logprobs dropped to stay under their cap (their blocks "
         "stay cached).", s.kv.scores.dropped),
        (c, "num_preemptions", "Sequences preempted for lack of KV blocks (recompute, or swap: see "
         "num_swap_outs).", s.preemptions),
        (c, "prompt_tokens", "Prompt tokens of requests that started generating.", s.prompt_tokens),
        (c, "generation_tokens", "Generated tokens.", s.generation_tokens),
        # Ours, not vLLM's: what the paged KV cache does with its blocks.
        (g, "kv_cache_cached_free_blocks",
         "Blocks nobody references that still hold prefix-cache content (reusable until evicted).",
         s.kv.cached_free_blocks),
        (g, "kv_cache_free_blocks", "Blocks holding nothing.", s.kv.free_blocks),
        (g, "kv_cache_total_blocks", "Blocks in the KV pool.", s.kv.num_blocks),
        (g, "kv_cache_waste_perc", "Allocated KV slots holding no token, as a fraction of allocated slots (eta).",
         s.kv.waste),
        (c, "computed_prompt_tokens", "Prefill tokens run (cache hits skip them, recompute repeats them).",
         s.computed_prompt_tokens),
        (c, "engine_steps", "Engine steps (forward passes) run.", s.steps),
        (c, "kv_cache_cow_copies", "Copy-on-write block copies.", s.kv.cow_copies),
        (c, "kv_cache_window_released_blocks", "Blocks sequences released below their sliding window "
         "(no later query reads them; they stay cached until evicted).", s.kv.window_released),
    ] + tier_rows(s) + adapter_rows(s) + [
        (g, "kv_cache_bytes_per_token", "KV bytes one token takes in the pool (2*L*d_kv*bytes, scales included "
         "when quantized).", s.bytes_per_token),
        (g, "kv_cache_blocks_per_gib", "KV blocks one GiB of pool holds at its dtype and block size.", s.blocks_per_gib),
    ] + ([] if s.spec is None else [
        # vLLM's speculative-decoding counters, and the acceptance rate they give.
        (c, "spec_decode_num_drafts", "Draft runs verified (a decode that carried draft tokens).", s.spec.num_drafts),
        (c, "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", s.spec.num_draft_tokens),
        (c, "spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.", s.spec.num_accepted_tokens),
        (g, "spec_decode_acceptance_rate", "Accepted / proposed draft tokens so far.", s.spec.acceptance_rate),
    ]) + ([] if s.grammar is None else [
        # Ours: structured outputs (vLLM counts none of these).
        (c, "structured_output_requests", "Requests with a JSON schema, regex, choice or grammar constraint.",
         s.grammar.requests),
        (c, "grammar_cache_queries", "Grammar lookups (one per constrained request).", s.grammar.cache_queries),
        (c, "grammar_cache_hits", "Grammar lookups that found the grammar compiled or compiling.",
         s.grammar.cache_hits),
        (c, "grammar_compiles", "Grammars compiled (or refused by the compiler).", s.grammar.compiles),
        (c, "grammar_compile_seconds", "Seconds spent compiling grammars (in the compiler process).",
         s.grammar.compile_seconds),
        (c, "grammar_compile_failures", "Grammars the compiler refused or that passed the compile deadline.",
         s.grammar.failures),
    ])


def adapter_rows(s: EngineStats) -> list[tuple[type, str, str, float]]:
    """Ours: LoRA adapters paged in the KV pool (kv.adapter_pages); zeros with none."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    a = s.kv.adapters
    if a is None:
        return []
    return [
        (g, "lora_adapters_resident", "LoRA adapters whose weights are in KV pool pages (held or idle).", a.resident),
        (g, "kv_cache_adapter_blocks", "KV pool blocks holding the weights of adapters running requests use.",
         a.held_pages),
        (g, "kv_cache_adapter_idle_blocks", "KV pool blocks holding idle adapters (free to take; counted as "
         "cached-free).", a.idle_pages),
        (c, "lora_adapter_loads", "Adapters written into KV pool pages, reloads after eviction included.", a.loads),
        (c, "lora_adapter_evictions", "Idle adapters whose pages the pool handed out.", a.evictions),
    ]


def tier_rows(s: EngineStats) -> list[tuple[type, str, str, float]]:
    """Ours: the second tier (--kv-offload-dir). Served with or without one (zeros without), so a
    dashboard's queries never find the series missing."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    kv = s.kv.tier or TierFigures()
    t = kv.store
    return [
        (c, "kv_tier_hits", "Prompt tokens served by blocks loaded from the second tier (also counted in "
         "prefix_cache_hits).", kv.hits),
        (c, "kv_tier_loaded_blocks", "Blocks read back from the tier into the KV pool.", kv.loaded_blocks),
        (c, "kv_tier_offloaded_blocks", "Blocks handed to the tier (written through, saved at eviction "
         "under write-back, saved by a swap-out).", kv.offloaded_blocks),
        (g, "kv_tier_backlog_blocks", "Write-through blocks waiting because too many writes are in flight.",
         kv.backlog),
        (g, "kv_tier_blocks", "Blocks the tier holds on disk.", t.blocks),
        (g, "kv_tier_bytes", "Bytes the tier's blocks take on disk (headers included).", t.bytes),
        (g, "kv_tier_capacity_bytes", "Most bytes the tier keeps on disk (--kv-offload-size; 0: no tier).",
         t.capacity_bytes),
        (c, "kv_tier_written_blocks", "Blocks the tier finished writing.", t.written_blocks),
        (c, "kv_tier_evicted_blocks", "Blocks the tier removed to stay under its capacity (least recently used).",
         t.evicted_blocks),
        (c, "kv_tier_read_failures", "Tier blocks skipped as corrupt, truncated or another engine's (recomputed).",
         t.read_failures),
        (c, "kv_tier_write_errors", "Tier writes that failed (the block stayed in the pool only).", t.write_errors),
        (c, "num_swap_outs", "Sequences preempted by swap (their full blocks saved to the tier).", kv.swap_outs),
        (c, "swap_out_blocks", "Blocks swap-outs saved to the tier.", kv.swap_out_blocks),
    ]


class EngineCollector(Collector):
    """Engine counters and gauges, read from the engine thread's latest snapshot (with data
    parallelism: the totals over the replicas)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, prefix: str) -> None:
        self.stats = stats
        self.labels = [model_name]
        self.prefix = prefix

    def collect(self):
        s = self.stats()
        for kind, name, doc, value in engine_rows(s):
            if value is None:  # a slot figure of a view that did not walk the tables
                continue
            f = kind(f"{self.prefix}:{name}", doc, labels=["model_name"])
            f.add_metric(self.labels, value)
            yield f
        f = GaugeMetricFamily(f"{self.prefix}:kv_cache_dtype_info", "How the KV pool stores K/V (--kv-cache-dtype), "
                              "as a label; the value is 1.", labels=["model_name", "kv_cache_dtype"])
        f.add_metric([*self.labels, s.kv_cache_dtype], 1.0)
        yield f
        yield from group_families(s, self.prefix, self.labels)
        if s.lora is not None:
            yield lora_info(s, self.prefix)


def lora_info(s: EngineStats, prefix: str) -> GaugeMetricFamily:
    """vLLM's lora_requests_info: the adapters of running and of waiting requests as labels
    (comma-separated names), max_lora; the value is when it was read (vLLM: the last update)."""
    import time

    f = GaugeMetricFamily(f"{prefix}:lora_requests_info", "Running stats on LoRA requests.",
                          labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    f.add_metric([",".join(s.lora.running), ",".join(s.lora.waiting), str(s.lora.max_loras)], time.time())
    return f


def group_families(s: EngineStats, prefix: str, labels: list[str]):
    """Ours: each KV layer group's blocks (kv.groups), labelled by group and attention kind: a model
    whose layers mix attention types frees its windowed groups' blocks while its full ones keep theirs."""
    held = GaugeMetricFamily(f"{prefix}:kv_cache_group_blocks", "Blocks a KV layer group's block tables hold "
                             "(one group per attention type and layer slice).", labels=["model_name", "group", "kind"])
    released = CounterMetricFamily(f"{prefix}:kv_cache_group_released_blocks", "Blocks a windowed layer group "
                                   "released below its window.", labels=["model_name", "group", "kind"])
    for i, g in enumerate(s.kv.groups):
        if g.held_blocks is not None:
            held.add_metric([*labels, str(i), g.kind], g.held_blocks)
        released.add_metric([*labels, str(i), g.kind], g.released)
    yield held
    yield released


class ReplicaCollector(Collector):
    """Each data-parallel replica's engine figures as `{prefix}:replica_<name>{replica="i"}`,
    beside the totals under the usual names (so sums over the totals never count twice).
    A replica's counters restart from 0 with its process; the totals do not."""

    def __init__(self, replicas: Callable[[], list[ReplicaFigures]], model_name: str, prefix: str) -> None:
        self.replicas, self.model_name, self.prefix = replicas, model_name, prefix

    def collect(self):
        reps = self.replicas()
        labels = ["model_name", "replica"]
        g, c = GaugeMetricFamily, CounterMetricFamily
        fams = {}
        extra = [(g, "replica_up", "1 while the replica serves, 0 while it restarts.", lambda r: float(r.alive)),
                 (c, "replica_restarts", "Times the replica's process was restarted after dying.",
                  lambda r: r.restarts),
                 (c, "replica_routed_requests", "Requests the router sent to the replica.", lambda r: r.routed)]
        for kind, name, doc, value in extra:
            f = fams[name] = kind(f"{self.prefix}:{name}", doc, labels=labels)
            for r in reps:
                f.add_metric([self.model_name, str(r.index)], value(r))
        for r in reps:
            if r.stats is None:
                continue
            for kind, name, doc, value in engine_rows(r.stats):
                if value is None:
                    continue
                key = "replica_" + name
                if key not in fams:
                    fams[key] = kind(f"{self.prefix}:{key}", f"Per replica: {doc}", labels=labels)
                fams[key].add_metric([self.model_name, str(r.index)], value)
        yield from fams.values()


class ServerMetrics:
    """The registry behind /metrics, and the engine thread's observer (on_step / on_finished)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, prefix: str = "pagedllm",
                 max_model_len: int = 4096, cache_info: dict[str, object] | None = None) -> None:
        if not prefix.replace("_", "").isalnum():
            raise ValueError(f"metrics prefix must be letters, digits and underscores, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name, prefix))
        self.model_name = model_name
        self._last_token: dict[str, float] = {}   # request id -> when its last token came (engine thread only)
        p, reg, lbl = prefix, self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{p}:{name}", doc, labelnames=lbl, buckets=buckets, registry=reg).labels(model_name)

        tokens = buckets_1_2_5(max_model_len)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between a request's consecutive tokens.", ITL_BUCKETS)
        # vLLM v1 still serves its deprecated name with the same per-token meaning; old dashboards read it.
        self.tpot_legacy = hist("time_per_output_token_seconds",
                                "Deprecated alias of inter_token_latency_seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first being scheduled.",
                          REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from the first token to the last.",
                           REQUEST_LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Time from first scheduled to the last token.",
                              REQUEST_LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: decode time / (output tokens - 1).", ITL_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per finished request (all its n).",
                            tokens)
        self.iteration = hist("iteration_tokens_total", "Tokens (prefill + decode) run per engine step.",
                              ITERATION_TOKEN_BUCKETS)
        self.param_n = hist("request_params_n", "The n sampling parameter per finished request.", N_BUCKETS)
        self.param_max_tokens = hist("request_params_max_tokens", "The max_tokens parameter per finished request.",
                                     tokens)
        self.success = Counter(f"{p}:request_success", "Finished requests by finish reason (once per request).",
                               labelnames=["model_name", "finished_reason"], registry=reg)
        if cache_info is not None:
            info = Gauge(f"{p}:cache_config_info", "Information of the KV cache configuration (value 1).",
                         labelnames=sorted(cache_info), registry=reg)
            info.labels(**{k: str(v) for k, v in cache_info.items()}).set(1)

    @classmethod
    def for_engine(cls, engine: EngineClient, model_name: str, prefix: str = "pagedllm") -> ServerMetrics:
        """Metrics of a serving engine, registered as its observer."""
        cfg, s = engine.info.cfg, engine.stats
        # vLLM's CacheConfig.metrics_info labels that have a meaning here.
        info = {"block_size": s.kv.block_size, "num_gpu_blocks": s.kv.num_blocks,
                "enable_prefix_caching": engine.info.enable_prefix_caching,
                "gpu_memory_utilization": cfg.gpu_memory_utilization, "cache_dtype": cfg.dtype}
        metrics = cls(lambda: engine.stats, model_name, prefix, engine.info.max_model_len, info)
        engine.observer = metrics
        figures = getattr(engine, "replica_figures", None)  # a data-parallel front: per-replica series too
        if figures is not None:
            metrics.registry.register(ReplicaCollector(figures, model_name, prefix))
        return metrics

    # -- engine-thread observer ------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], tokens: int, moved: list[str]) -> None:
        """After each step: its token count, the requests that got tokens (their gaps), and
        the outputs it made (a finished one's is its last)."""
        now = time.time()
        if tokens:
            self.iteration.observe(tokens)
        for rid in moved:
            last = self._last_token.get(rid)
            if last is not None and now > last:
                self.itl.observe(now - last)
                self.tpot_legacy.observe(now - last)
            self._last_token[rid] = now
        for out in outputs:
            if out.finished:
                self.on_finished(out)

    def on_finished(self, out: RequestOutput) -> None:
        """Once per request, whatever its n: finished, aborted (client gone) or failed."""
        self._last_token.pop(out.request_id, None)
        m = out.metrics
        arrival, sched = m.get("arrival_time"), m.get("scheduled_time")
        first, done = m.get("first_token_time"), m.get("finish_time")
        reasons = [c.finish_reason for c in out.outputs]
        reason = "abort" if "abort" in reasons or not reasons else (reasons[0] or "abort")
        self.success.labels(self.model_name, reason).inc()
        # A DELTA output's token_ids are its last few: the lengths travel in its metrics.
        gen = m.get("output_lens") or [len(c.token_ids) for c in out.outputs]
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.gen_len.observe(sum(gen))
        if m.get("n") is not None:
            self.param_n.observe(m["n"])
        if m.get("max_tokens") is not None:
            self.param_max_tokens.observe(m["max_tokens"])
        if first is not None:
            self.ttft.observe(first - arrival)
        if done is not None:
            self.e2e.observe(done - arrival)
        if sched is not None:
            self.queue.observe(sched - arrival)
            if first is not None:
                self.prefill.observe(first - sched)
            if done is not None:
                self.inference.observe(done - sched)
        if first is not None and done is not None:
            self.decode.observe(done - first)
            if max(gen, default=0) > 1:
                self.tpot.observe((done - first) / (max(gen) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
