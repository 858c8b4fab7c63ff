"""Two engines behind one address, side by side in one run: the SGLang Model Gateway in front
of two `pagedllm serve` workers, against one `pagedllm serve --data-parallel-size 2`.

    python benchmarks/gateway_vs_dp.py --num-prompts 48 --max-concurrency 8 \\
        --out benchmarks/results/gateway_vs_dp.json

gateway: two workers, each with cores / 2 threads (as a replica gets), behind sglang-router
(--policy cache_aware: an approximate radix tree of the request text it sent each worker).
dp2: one server whose prefix router keeps a record of the block hashes it sent each replica
(pagedllm/dp/router.py). Same model, dtype, KV pool per engine, max_model_len and workload:
chat-shared-system, conversations behind one of 8 system prompts picked at random. The hit
rate is the run's own: the change in the engines' prefix-cache counters (the two workers'
/metrics added up; the DP server's totals). TTFT and TPOT as vLLM defines them (mean,
median, P99; pagedllm/bench/serve_client.py). Servers start cold, one layout at a time.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from importlib.metadata import version
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.bench.data_parallel import ServeProcess, routed_per_replica, threads_used
from pagedllm.bench.gateway import Gateway
from pagedllm.bench.provenance import save_result
from pagedllm.bench.serve_client import run_serve_bench
from pagedllm.bench.workloads import WorkloadOptions, load_workload
from pagedllm.loader import load_tokenizer, resolve_model_dir
from pagedllm.runtime.threads import resolve_num_threads

KEYS = ("output_throughput", "prefix_hit_rate", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "completed", "failed", "duration")


def finished(url: str) -> int:
    """Requests a server has finished, whatever the reason."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "pagedllm:request_success_total"))


def gateway_layout(reqs, args, server_args: list[str], threads: int) -> dict:
    workers = []
    try:
        for i in range(2):
            workers.append(ServeProcess(f"gw-worker{i}", [*server_args, "--num-threads", str(threads)]))
        gw = Gateway([w.url for w in workers], "cache_aware")
        try:
            name = httpx.get(gw.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            before = [finished(w.url) for w in workers]
            r = run_serve_bench(gw.url, name, reqs, args.request_rate, args.max_concurrency, args.seed,
                                counter_urls=[w.url for w in workers])
            per_engine = [finished(w.url) - b for w, b in zip(workers, before)]
        finally:
            gw.stop()
    finally:
        for w in workers:
            w.stop()
    return {"label": "gateway cache_aware, 2 workers", "model": name, **{k: r[k] for k in KEYS},
            "requests_per_engine": per_engine, "threads_per_engine": [threads_used(w.text())[0] for w in workers]}


def dp_layout(reqs, args, server_args: list[str]) -> dict:
    server = ServeProcess("dp2", ["--data-parallel-size", "2", "--router-policy", "prefix", *server_args])
    try:
        name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = run_serve_bench(server.url, name, reqs, args.request_rate, args.max_concurrency, args.seed)
        per_engine = routed_per_replica(server.url, 2)
    finally:
        server.stop()
    return {"label": "--data-parallel-size 2, prefix", "model": name, **{k: r[k] for k in KEYS},
            "requests_per_engine": per_engine, "threads_per_engine": threads_used(server.text())}


def report(rows: list[dict]) -> list[str]:
    """The table, then the gateway's figures as ratios to dp2's."""
    gw, dp = rows
    lines = [f"{'layout':<34} {'out tok/s':>9} {'hit rate':>9} {'TTFT mean':>10} {'median':>8} {'P99':>8}"
             f" {'TPOT mean':>10} {'median':>7} {'P99':>7}  requests/engine  threads/engine  failed"]
    for r in rows:
        lines.append(f"{r['label']:<34} {r['output_throughput']:9.1f} {100 * r['prefix_hit_rate']:8.1f}%"
                     f" {r['mean_ttft_ms']:8.0f}ms {r['median_ttft_ms']:6.0f}ms {r['p99_ttft_ms']:6.0f}ms"
                     f" {r['mean_tpot_ms']:8.1f}ms {r['median_tpot_ms']:5.1f}ms {r['p99_tpot_ms']:5.1f}ms"
                     f"  {'/'.join(map(str, r['requests_per_engine'])):<15}"
                     f"  {'/'.join(map(str, r['threads_per_engine'])):<14}  {r['failed']}"
                     f"  (load before {r['load_average_1min_before']:.2f})")
    ratios = ", ".join(f"{k} {gw[k] / dp[k]:.2f}x" for k in ("output_throughput", "prefix_hit_rate", "mean_ttft_ms",
                                                              "median_ttft_ms", "p99_ttft_ms") if dp[k])
    lines.append(f"gateway / dp2, same run: {ratios}; hit rate "
                 f"{100 * (gw['prefix_hit_rate'] - dp['prefix_hit_rate']):+.1f} points")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="served model and the workload's tokenizer (default model)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-system-prompts", type=int, default=8)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: no pacing")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--server-args", default="--dtype float32 --kv-cache-memory 256MiB --max-model-len 2048",
                   help="`pagedllm serve` flags of every engine (each worker and replica gets its own KV pool)")
    p.add_argument("--note", default="", help="recorded with the result (e.g. the machine's other load)")
    p.add_argument("--out", default="benchmarks/results/gateway_vs_dp.json")
    args = p.parse_args()

    server_args = shlex.split(args.server_args) + (["--model", args.model] if args.model else [])
    opts = WorkloadOptions(num_prompts=args.num_prompts, seed=args.seed, max_output_len=args.max_output_len,
                           num_system_prompts=args.num_system_prompts)
    reqs = load_workload("chat-shared-system", load_tokenizer(resolve_model_dir(args.model)), opts)
    threads = max(1, resolve_num_threads(None)[0] // 2)  # what each of 2 replicas gets
    load_before = os.getloadavg()
    lines = [f"workload: chat-shared-system, {len(reqs)} requests behind {args.num_system_prompts} system prompts, "
             f"mean prompt {sum(r.prompt_len for r in reqs) / len(reqs):.0f} tokens, mean output "
             f"{sum(r.output_len for r in reqs) / len(reqs):.0f} tokens, at most {args.max_concurrency} in flight, "
             f"rate {args.request_rate}; load average before: {load_before[0]:.2f}"]
    print(lines[0], flush=True)
    rows = []
    for run in (lambda: gateway_layout(reqs, args, server_args, threads), lambda: dp_layout(reqs, args, server_args)):
        load = os.getloadavg()[0]  # the other processes' share of the cores, when the machine is shared
        rows.append({**run(), "load_average_1min_before": load})
    lines += report(rows)
    print("\n".join(lines[1:]))
    command = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    save_result({"benchmark": "gateway_vs_dp", "command": command, "workload": "chat-shared-system",
                 "workload_options": opts.as_dict(), "server_args": server_args, "max_concurrency": args.max_concurrency,
                 "request_rate": args.request_rate,
                 "gateway": f"sglang-router {version('sglang-router')}, --policy cache_aware",
                 "load_average_before": load_before, "note": args.note, "results": rows}, args.out)
    Path(args.out).with_suffix(".txt").write_text("\n".join([f"$ {command}", args.note, *lines]) + "\n")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.txt')}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
