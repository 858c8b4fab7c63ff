"""Two engine replicas behind one address on one machine, side by side in one run: Ray Serve
(`pagedllm serve --ray --replicas 2`: a local Ray, the ingress deployment and our prefix
request router) against our own front (`pagedllm serve --data-parallel-size 2`, dp/), the
question issue 42 asks before dp/ may stay: which is the better single-host path.

    python -m benchmarks ray_serve_vs_dp --num-prompts 48 --max-concurrency 8 --rounds 2 \\
        --out benchmarks/results/ray_serve_vs_dp.json

Same model, dtype, KV pool per replica, max_model_len and workload as gateway_vs_dp:
chat-shared-system, conversations behind one of 8 system prompts picked at random. Each
replica gets one of the two cores (Ray: a 1-CPU actor, its OMP_NUM_THREADS 1; dp: cores / 2
threads). The hit rate is the clients' own: cached prompt tokens (usage.prompt_tokens_details)
over prompt tokens. Servers start cold, one layout at a time, --rounds times in ABBA order;
the ratios are of the means over the rounds. Start-up (process start to /health answering)
is recorded too.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from importlib.metadata import version
from pathlib import Path

import httpx

from benchmarks.gateway_vs_dp import KEYS, where
from benchmarks.lib.data_parallel import ServeProcess
from pagedllm.bench.provenance import provenance, save_result
from pagedllm.bench.serve_client import run_serve_bench
from pagedllm.bench.workloads import WorkloadOptions, load_workload
from pagedllm.loader import load_tokenizer, resolve_model_dir

RAY, DP = "Ray Serve, 2 replicas (--ray)", "--data-parallel-size 2 (dp/)"
LAYOUTS = {RAY: ["--ray", "--replicas", "2"], DP: ["--data-parallel-size", "2", "--router-policy", "prefix"]}
RATIO_KEYS = ("output_throughput", "hit_rate", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")


def layout(label: str, reqs, args, server_args: list[str]) -> dict:
    t0 = time.perf_counter()
    server = ServeProcess(label.split()[0].lower(), [*LAYOUTS[label], *server_args])
    startup = time.perf_counter() - t0
    try:
        name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = run_serve_bench(server.url, name, reqs, args.request_rate, args.max_concurrency, args.seed)
    finally:
        server.stop()
    return {"label": label, "model": name, **{k: r[k] for k in KEYS}, "startup_s": startup,
            "hit_rate": r["cached_tokens"] / max(r["total_input_tokens"], 1)}


def mean(rows: list[dict], label: str) -> dict:
    mine = [r for r in rows if r["label"] == label]
    keys = (*KEYS, "hit_rate", "startup_s")
    return {"label": label + " (mean)", **{k: sum(r[k] for r in mine) / len(mine) for k in keys}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-system-prompts", type=int, default=8)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--server-args", default="--dtype float32 --kv-cache-memory 256MiB --max-model-len 2048",
                   help="`pagedllm serve` flags of every replica")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/ray_serve_vs_dp.json")
    args = p.parse_args()
    server_args = shlex.split(args.server_args)
    opts = WorkloadOptions(num_prompts=args.num_prompts, seed=args.seed, max_output_len=args.max_output_len,
                           num_system_prompts=args.num_system_prompts)
    reqs = load_workload("chat-shared-system", load_tokenizer(resolve_model_dir(None)), opts)
    load_before = os.getloadavg()
    rows = []
    for k in range(args.rounds):
        for label in (RAY, DP) if k % 2 == 0 else (DP, RAY):
            rows.append({**layout(label, reqs, args, server_args), "round": k})
            r = rows[-1]
            print(f"{label}, round {k}: {r['output_throughput']:.1f} out tok/s, hit rate {100 * r['hit_rate']:.1f}%, "
                  f"TTFT median {r['median_ttft_ms']:.0f} ms P99 {r['p99_ttft_ms']:.0f} ms, start-up "
                  f"{r['startup_s']:.1f} s, failed {r['failed']}", flush=True)
    ray, dp = mean(rows, RAY), mean(rows, DP)
    ratios = {k: ray[k] / dp[k] for k in RATIO_KEYS if dp[k]}
    line = "ray / dp, means over the rounds: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    print(line)
    command = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    save_result({"benchmark": "ray_serve_vs_dp", "command": command, "workload": "chat-shared-system",
                 "workload_options": opts.as_dict(), "server_args": server_args,
                 "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
                 "ray": f"ray {version('ray')}", "load_average_before": load_before, "rounds": args.rounds,
                 "results": rows, "ray_mean": ray, "dp2_mean": dp, "ray_over_dp2": ratios}, args.out)
    Path(args.out).with_suffix(".txt").write_text("\n".join([f"$ {command}", where(provenance()), line]) + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
