"""`pagedllm bench serve`: drive a running server over HTTP (vLLM's definitions).

TTFT: request sent -> first token. TPOT: (latency - TTFT) / (output_len - 1).
ITL: gaps between streamed chunks. The prefix hit rate is this run's own: the change in
the server's prefix-cache counters during the run, not since the server started.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx

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
               seed: int, api_key: str | None) -> tuple[list[dict], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max(concurrency or len(reqs), 1) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits) as client:
        async def guarded(r):
            if sem is None:
                return await _one(client, model, r, headers)
            async with sem:
                return await _one(client, model, r, headers)
        tasks = []
        t0 = time.perf_counter()
        for r in reqs:
            tasks.append(asyncio.ensure_future(guarded(r)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def run_serve_bench(base_url: str, model: str, reqs: list[BenchRequest], rate: float = float("inf"),
                    concurrency: int | None = None, seed: int = 0, api_key: str | None = None) -> dict:
    q0, h0 = _prefix_counters(base_url)
    results, duration = asyncio.run(_run(base_url, model, reqs, rate, concurrency, seed, api_key))
    q1, h1 = _prefix_counters(base_url)
    ok = [r for r in results if r["ok"]]
    ms = lambda xs: [1000 * x for x in xs]  # noqa: E731
    ttft, tpot = ms([r["ttft"] for r in ok]), ms([r["tpot"] for r in ok if r["tpot"] is not None])
    itl = ms([x for r in ok for x in r["itl"]])
    out_tok = sum(r["output_tokens"] for r in ok)
    return {
        "base_url": base_url, "model": model, "request_rate": rate, "max_concurrency": concurrency,
        "num_requests": len(reqs), "successful_requests": len(ok), "failed": [r["error"] for r in results if not r["ok"]],
        "duration_s": duration, "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_input_tokens": sum(r["prompt_tokens"] for r in ok), "total_output_tokens": out_tok,
        "ttft_ms": _summary(ttft), "tpot_ms": _summary(tpot), "itl_ms": _summary(itl),
        "prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "cached_tokens": sum(r["cached_tokens"] for r in ok), "ttft_all_ms": ttft, "latency_all_s": [r["latency"] for r in ok],
    }


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    xs = sorted(xs)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def print_serve(r: dict) -> None:
    line = "{:<40}{:<10}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(line.format("Successful requests:", r["successful_requests"]))
    print(line.format("Benchmark duration (s):", f"{r['duration_s']:.2f}"))
    print(line.format("Total input tokens:", r["total_input_tokens"]))
    print(line.format("Total generated tokens:", r["total_output_tokens"]))
    print(line.format("Request throughput (req/s):", f"{r['request_throughput']:.2f}"))
    print(line.format("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        print("{s:{c}^{n}}".format(s=f" {name} ", n=50, c="-"))
        print(line.format(f"Mean {name} (ms):", f"{r[key]['mean']:.2f}"))
        print(line.format(f"Median {name} (ms):", f"{r[key]['median']:.2f}"))
        print(line.format(f"P99 {name} (ms):", f"{r[key]['p99']:.2f}"))
    print("-" * 50)
    print(line.format("Prefix cache hit rate (this run):", f"{100 * r['prefix_hit_rate']:.1f}%"))
    print("=" * 50)
