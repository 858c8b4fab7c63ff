"""Prometheus metrics with vLLM's names and meanings, under the pagedllm: prefix."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.engine import EngineStats
from ..outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)


class EngineCollector(Collector):
    """Engine counters and gauges, read from the engine thread's latest snapshot."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.labels = [model_name]

    def _family(self, kind, name: str, doc: str, value: float):
        f = kind(f"pagedllm:{name}", doc, labels=["model_name"])
        f.add_metric(self.labels, value)
        return f

    def collect(self):
        s = self.stats()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "num_requests_running", "Requests with a sequence in the running batch.", s.num_running)
        yield self._family(g, "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._family(g, "kv_cache_usage_perc", "KV-cache usage: fraction of blocks held by requests (1 = full).",
                           s.kv_usage)
        yield self._family(g, "kv_cache_cached_free_blocks",
                           "Blocks nobody references that still hold prefix-cache content (reusable until evicted).",
                           s.cached_free_blocks)
        yield self._family(g, "kv_cache_free_blocks", "Blocks holding nothing.", s.free_blocks)
        yield self._family(g, "kv_cache_total_blocks", "Blocks in the KV pool.", s.num_blocks)
        yield self._family(g, "kv_cache_waste_perc",
                           "Allocated KV slots holding no token, as a fraction of allocated slots (eta).", s.waste)
        yield self._family(c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries)
        yield self._family(c, "prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hits)
        yield self._family(c, "num_preemptions", "Sequences preempted (recompute) for lack of KV blocks.",
                           s.preemptions)
        yield self._family(c, "prompt_tokens", "Prompt tokens of requests that started generating.", s.prompt_tokens)
        yield self._family(c, "generation_tokens", "Generated tokens.", s.generation_tokens)
        yield self._family(c, "computed_prompt_tokens", "Prefill tokens run (cache hits skip them, recompute "
                           "repeats them).", s.computed_prompt_tokens)
        yield self._family(c, "engine_steps", "Engine steps (forward passes) run.", s.steps)
        yield self._family(c, "kv_cache_cow_copies", "Copy-on-write block copies.", s.cow_copies)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        self.model_name = model_name
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, **kw)
        self.tpot = Histogram("pagedllm:time_per_output_token_seconds",
                              "Time per output token after the first, per request.", buckets=_TPOT_BUCKETS, **kw)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_LATENCY_BUCKETS, **kw)
        self.success = Counter("pagedllm:request_success", "Finished requests by finish reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
        if first is not None:
            self.ttft.labels(self.model_name).observe(first - arrival)
        if done is not None:
            self.e2e.labels(self.model_name).observe(done - arrival)
            n = max(len(c.token_ids) for c in out.outputs)
            if first is not None and n > 1:
                self.tpot.labels(self.model_name).observe((done - first) / (n - 1))
        for c in out.outputs:
            self.success.labels(self.model_name, c.finish_reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
