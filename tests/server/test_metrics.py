"""/metrics against a real server: vLLM v1's names, types, buckets and meanings."""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL, metrics
from .inproc import serve_in_process

# vLLM v1 families and their Prometheus types (counters without the _total the client adds).
VLLM_FAMILIES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "num_preemptions": "counter",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "request_inference_time_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram", "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram", "iteration_tokens_total": "histogram",
    "request_params_n": "histogram", "request_params_max_tokens": "histogram", "cache_config_info": "gauge",
}
OURS = {"kv_cache_cached_free_blocks": "gauge", "kv_cache_waste_perc": "gauge", "kv_cache_cow_copies": "counter",
        "kv_cache_window_released_blocks": "counter",
        "prompt_logprobs_cache_queries": "counter", "prompt_logprobs_cache_hits": "counter",
        "prompt_logprobs_cache_blocks": "gauge"}
# The second tier's, served with or without a tier (zeros without).
TIER = {"kv_tier_hits": "counter", "kv_tier_loaded_blocks": "counter", "kv_tier_offloaded_blocks": "counter",
        "kv_tier_backlog_blocks": "gauge", "kv_tier_blocks": "gauge", "kv_tier_bytes": "gauge",
        "kv_tier_capacity_bytes": "gauge", "kv_tier_written_blocks": "counter", "kv_tier_evicted_blocks": "counter",
        "kv_tier_read_failures": "counter", "kv_tier_write_errors": "counter", "num_swap_outs": "counter",
        "swap_out_blocks": "counter"}


def families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(server.client().get("/metrics", timeout=10).text)}


def buckets(fam) -> list[float]:
    return sorted({float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")})


def complete(server, **body) -> dict:
    r = server.client().post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                       "ignore_eos": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_names_types_and_buckets(server):
    complete(server, max_tokens=4)
    fams = families(server)
    for name, kind in {**VLLM_FAMILIES, **OURS, **TIER}.items():
        assert f"pagedllm:{name}" in fams, name
        assert fams[f"pagedllm:{name}"].type == kind, name
    # This server has no tier: its series are there, at zero.
    assert {name: fams[f"pagedllm:{name}"].samples[0].value for name in TIER} == dict.fromkeys(TIER, 0.0)
    assert "swap" in fams["pagedllm:num_preemptions"].documentation
    assert buckets(fams["pagedllm:time_to_first_token_seconds"])[:3] == [0.001, 0.005, 0.01]
    assert buckets(fams["pagedllm:inter_token_latency_seconds"])[:2] == [0.01, 0.025]
    assert buckets(fams["pagedllm:e2e_request_latency_seconds"])[:2] == [0.3, 0.5]
    assert buckets(fams["pagedllm:request_prompt_tokens"])[:4] == [1, 2, 5, 10]
    info = fams["pagedllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    assert info.labels["enable_prefix_caching"] == "True"


def test_per_token_and_per_request_timings(server):
    before = metrics(server)
    # Streamed or not, 6 tokens of one sequence are 5 inter-token gaps.
    complete(server, max_tokens=6)
    after = metrics(server)

    def delta(name: str) -> float:
        return after[f"pagedllm:{name}"] - before.get(f"pagedllm:{name}", 0.0)

    assert delta("inter_token_latency_seconds_count") == 5
    assert delta("request_time_per_output_token_seconds_count") == 1
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "e2e_request_latency_seconds"):
        assert delta(f"{name}_count") == 1, name
    # Meanings: inference = prefill + decode, and e2e covers queue + inference.
    inference = delta("request_inference_time_seconds_sum")
    assert inference == pytest.approx(delta("request_prefill_time_seconds_sum")
                                      + delta("request_decode_time_seconds_sum"), abs=1e-6)
    assert delta("e2e_request_latency_seconds_sum") >= inference
    assert delta("request_generation_tokens_sum") == 6
    assert delta("iteration_tokens_total_sum") >= 6, "every prefill and decode token runs in some step"


def test_n_samples_count_as_one_request(server):
    before = metrics(server)
    out = complete(server, max_tokens=3, n=3, temperature=1.0, seed=1)
    assert len(out["choices"]) == 3
    after = metrics(server)
    assert after["pagedllm:request_success_total"] - before.get("pagedllm:request_success_total", 0) == 1
    assert after["pagedllm:e2e_request_latency_seconds_count"] - before["pagedllm:e2e_request_latency_seconds_count"] == 1
    assert after["pagedllm:request_params_n_sum"] - before.get("pagedllm:request_params_n_sum", 0) == 3
    assert after["pagedllm:request_generation_tokens_sum"] - before["pagedllm:request_generation_tokens_sum"] == 9


def aborts(server) -> float:
    for s in families(server)["pagedllm:request_success"].samples:
        if s.name.endswith("_total") and s.labels["finished_reason"] == "abort":
            return s.value
    return 0.0


def test_disconnect_counts_as_abort(socket_server):
    """A client that leaves mid-stream (a real socket closed) is counted once, as an abort."""
    server = socket_server
    before, total = aborts(server), metrics(server).get("pagedllm:request_success_total", 0)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with server.client().stream("POST", "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token arrived: leave
    deadline = time.time() + 30
    while aborts(server) == before and time.time() < deadline:
        time.sleep(0.2)
    assert aborts(server) == before + 1
    assert metrics(server)["pagedllm:request_success_total"] == total + 1, "counted once"


@pytest.fixture(scope="module")
def vllm_server(tiny_flags):
    """The tiny model's: only the metric names are checked."""
    s = serve_in_process(*tiny_flags, "--metrics-prefix", "vllm")
    yield s
    s.close()


def test_metrics_prefix_vllm(vllm_server):
    from tiny import TINY_NAME

    complete(vllm_server, max_tokens=2, model=TINY_NAME)
    fams = families(vllm_server)
    assert not [n for n in fams if n.startswith("pagedllm:")]
    for name, kind in VLLM_FAMILIES.items():
        assert fams[f"vllm:{name}"].type == kind, name
    m = metrics(vllm_server)
    assert m["vllm:request_success_total"] == 1 and m["vllm:generation_tokens_total"] == 2


def tier_stats(hits: int, blocks: int, read_failures: int = 0):
    """An engine's stats with a tier holding `blocks` blocks of 1000 bytes (no engine needed)."""
    from dataclasses import replace

    from pagedllm.dp.stats import zero_stats
    from pagedllm.kv import TierFigures
    from pagedllm.kv.tier_store import TierStats

    z = zero_stats(16, 100)
    store = TierStats(capacity_bytes=2**30, blocks=blocks, bytes=1000 * blocks, written_blocks=blocks + 2,
                      write_errors=1, evicted_blocks=2, read_blocks=hits // 16, read_failures=read_failures)
    tier = TierFigures("write_through", hits=hits, loaded_blocks=hits // 16, offloaded_blocks=blocks + 3, backlog=1,
                       swap_outs=3, swap_out_blocks=7, store=store)
    return replace(z, preemptions=3, kv=replace(z.kv, pool=replace(z.kv.pool, num_blocks=64), prefix_queries=4 * hits,
                                                prefix_hits=2 * hits, tier=tier))


def collect(stats) -> dict[str, tuple[str, float]]:
    from pagedllm.server.metrics import EngineCollector

    return {f.name.removeprefix("pagedllm:"): (f.type, f.samples[0].value)
            for f in EngineCollector(lambda: stats, "m", "pagedllm").collect()}


def test_tier_series_carry_the_tier_figures():
    got = collect(tier_stats(hits=160, blocks=40, read_failures=1))
    assert {k: got[k] for k in TIER} == {
        "kv_tier_hits": ("counter", 160), "kv_tier_loaded_blocks": ("counter", 10),
        "kv_tier_offloaded_blocks": ("counter", 43), "kv_tier_backlog_blocks": ("gauge", 1),
        "kv_tier_blocks": ("gauge", 40), "kv_tier_bytes": ("gauge", 40_000),
        "kv_tier_capacity_bytes": ("gauge", 2**30), "kv_tier_written_blocks": ("counter", 42),
        "kv_tier_evicted_blocks": ("counter", 2), "kv_tier_read_failures": ("counter", 1),
        "kv_tier_write_errors": ("counter", 1), "num_swap_outs": ("counter", 3), "swap_out_blocks": ("counter", 7)}
    assert got["prefix_cache_hits"] == ("counter", 320) and got["num_preemptions"] == ("counter", 3)


def test_data_parallel_totals_add_up_the_tiers():
    """A data-parallel server's totals: each replica's tier adds up, a dead replica's tier
    counters are kept and its blocks on disk are not; a replica's tier figures survive the pipe."""
    import pickle

    from pagedllm.dp.stats import counters_only, sum_stats, zero_stats

    a, b = tier_stats(hits=160, blocks=40), pickle.loads(pickle.dumps(tier_stats(hits=32, blocks=5)))
    got = collect(sum_stats([counters_only(b), a, zero_stats(16, 100)]))
    assert got["kv_tier_hits"][1] == 192 and got["kv_tier_loaded_blocks"][1] == 12 and got["num_swap_outs"][1] == 6
    assert got["kv_tier_written_blocks"][1] == 42 + 7 and got["kv_tier_write_errors"][1] == 2
    assert (got["kv_tier_blocks"][1], got["kv_tier_bytes"][1], got["kv_tier_capacity_bytes"][1]) == (40, 40_000, 2**30)
    assert got["kv_tier_backlog_blocks"][1] == 1, "a dead replica's backlog is gone with it"
    assert sum_stats([zero_stats(16)]).kv.tier is None and collect(zero_stats(16))["kv_tier_blocks"] == ("gauge", 0)
