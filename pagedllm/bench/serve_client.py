"""`pagedllm bench serve`: drive a running server over HTTP (vLLM's definitions).

TTFT: request sent -> first token. TPOT: (latency - TTFT) / (output_len - 1).
ITL: gaps between streamed chunks. E2EL: request sent -> last chunk. Percentiles as numpy's
(linear interpolation), as vLLM computes them. The prefix hit rate is this run's own: the change in
the server's prefix-cache counters during the run, not since the server started.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import numpy as np

from .sharegpt import BenchRequest


async def _one(client: httpx.AsyncClient, model: str, r: BenchRequest, headers: dict) -> dict:
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, itl, out_tokens, cached, err = None, None, [], 0, 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                return {"ok": False, "error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    out_tokens = chunk["usage"]["completion_tokens"]
                    cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        err = repr(e)
    latency = time.perf_counter() - t0
    if err or ttft is None:
        return {"ok": False, "error": err or "no tokens"}
    return {"ok": True, "ttft": ttft, "latency": latency, "itl": itl, "output_tokens": out_tokens,
            "prompt_tokens": r.prompt_len, "cached_tokens": cached,
            "tpot": (latency - ttft) / (out_tokens - 1) if out_tokens > 1 else None}


def _prefix_counters(base_url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    q = h = 0.0
    for fam in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "pagedllm:prefix_cache_queries_total":
                q += s.value
            elif s.name == "pagedllm:prefix_cache_hits_total":
                h += s.value
    return q, h


async def _run(base_url: str, model: str, reqs: list[BenchRequest], rate: float, concurrency: int | None,
               seed: int, api_key: str | None, progress: bool) -> tuple[list[dict], float]:
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max(concurrency or len(reqs), 1) + 4)
    bar = tqdm(total=len(reqs), disable=not progress)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits) as client:
        async def guarded(r):
            try:
                if sem is None:
                    return await _one(client, model, r, headers)
                async with sem:
                    return await _one(client, model, r, headers)
            finally:
                bar.update(1)
        tasks = []
        t0 = time.perf_counter()
        for r in reqs:
            tasks.append(asyncio.ensure_future(guarded(r)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration


# (key, label, section header) as vLLM's benchmark_serving prints them.
LATENCY_METRICS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                   ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def run_serve_bench(base_url: str, model: str, reqs: list[BenchRequest], rate: float = float("inf"),
                    concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
                    percentiles: tuple[float, ...] = (99,), progress: bool = False,
                    counter_urls: list[str] | None = None) -> dict:
    """vLLM's result JSON: flat keys (mean_ttft_ms, p99_itl_ms, completed, duration, ...), plus
    prefix_hit_rate and cached_tokens, which vLLM does not measure. counter_urls: the servers
    whose prefix-cache counters make the hit rate (default base_url; behind a gateway, its
    workers)."""
    urls = counter_urls or [base_url]
    q0, h0 = map(sum, zip(*map(_prefix_counters, urls)))
    results, duration = asyncio.run(_run(base_url, model, reqs, rate, concurrency, seed, api_key, progress))
    q1, h1 = map(sum, zip(*map(_prefix_counters, urls)))
    ok = [r for r in results if r["ok"]]
    in_tok, out_tok = sum(r["prompt_tokens"] for r in ok), sum(r["output_tokens"] for r in ok)
    samples = {"ttft": [r["ttft"] for r in ok], "tpot": [r["tpot"] for r in ok if r["tpot"] is not None],
               "itl": [x for r in ok for x in r["itl"]], "e2el": [r["latency"] for r in ok]}
    out = {
        "base_url": base_url, "model_id": model, "request_rate": rate, "max_concurrency": concurrency,
        "num_prompts": len(reqs), "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "input_lens": [r["prompt_tokens"] for r in ok], "output_lens": [r["output_tokens"] for r in ok],
        "ttfts": samples["ttft"], "itls": [r["itl"] for r in ok], "errors": [r["error"] for r in results if not r["ok"]],
        "prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "cached_tokens": sum(r["cached_tokens"] for r in ok), "percentiles": list(percentiles),
    }
    for key, xs in samples.items():
        ms = [1000 * x for x in xs] or [0.0]  # vLLM reports 0 for an empty sample
        out[f"mean_{key}_ms"], out[f"median_{key}_ms"] = float(np.mean(ms)), float(np.median(ms))
        out[f"std_{key}_ms"] = float(np.std(ms))
        for p in percentiles:
            out[f"p{_pword(p)}_{key}_ms"] = float(np.percentile(ms, p))
    return out


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def print_serve(r: dict, metrics: tuple[str, ...] = ("ttft", "tpot", "itl")) -> None:
    """vLLM's summary block, label for label, then our prefix hit rate."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", r["completed"]))
    print("{:<40} {:<10}".format("Failed requests:", r["failed"]))
    if r.get("max_concurrency"):
        print("{:<40} {:<10}".format("Maximum request concurrency:", r["max_concurrency"]))
    if r["request_rate"] != float("inf"):
        print("{:<40} {:<10.2f}".format("Request rate configured (RPS):", r["request_rate"]))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", r["duration"]))
    print("{:<40} {:<10}".format("Total input tokens:", r["total_input_tokens"]))
    print("{:<40} {:<10}".format("Total generated tokens:", r["total_output_tokens"]))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", r["request_throughput"]))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", r["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Total Token throughput (tok/s):", r["total_token_throughput"]))
    for key, name, header in LATENCY_METRICS:
        if key not in metrics:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {name} (ms):", r[f"mean_{key}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {name} (ms):", r[f"median_{key}_ms"]))
        for p in r.get("percentiles", [99]):
            print("{:<40} {:<10.2f}".format(f"P{_pword(p)} {name} (ms):", r[f"p{_pword(p)}_{key}_ms"]))
    print("{s:{c}^{n}}".format(s="Prefix cache (ours)", n=50, c="-"))
    print("{:<40} {:<10}".format("Prefix cache hit rate (this run):", f"{100 * r['prefix_hit_rate']:.1f}%"))
    print("=" * 50)
