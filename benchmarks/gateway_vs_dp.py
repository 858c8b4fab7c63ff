"""Two engines behind one address, side by side in one run: the SGLang Model Gateway in front
of two `pagedllm serve` workers, against one `pagedllm serve --data-parallel-size 2`.

    python -m benchmarks gateway_vs_dp --num-prompts 48 --max-concurrency 8 --rounds 2 \\
        --out benchmarks/results/gateway_vs_dp.json

gateway: two workers, each with cores / 2 threads (as a replica gets), behind sglang-router
(--policy cache_aware: an approximate radix tree of the request text it sent each worker).
dp2: one server whose prefix router keeps a record of the block hashes it sent each replica
(pagedllm/dp/router.py). Same model, dtype, KV pool per engine, max_model_len and workload:
chat-shared-system, conversations behind one of 8 system prompts picked at random. The hit
rate is the run's own: the change in the engines' prefix-cache counters (the two workers'
/metrics added up; the DP server's totals). TTFT and TPOT as vLLM defines them (mean,
median, P99; pagedllm/bench/serve_client.py). Servers start cold, one layout at a time,
each layout --rounds times in ABBA order (a neighbour's load on a shared machine then falls
on both); the ratios are of the means over the rounds.
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

from benchmarks.lib.data_parallel import ServeProcess, routed_per_replica, threads_used
from benchmarks.lib.gateway import Gateway
from pagedllm.bench.provenance import provenance, save_result
from pagedllm.bench.serve_client import run_serve_bench
from pagedllm.bench.workloads import WorkloadOptions, load_workload
from pagedllm.loader import load_tokenizer, resolve_model_dir
from pagedllm.runtime.threads import resolve_num_threads

GATEWAY, DP = "gateway cache_aware, 2 workers", "--data-parallel-size 2, prefix"
KEYS = ("output_throughput", "prefix_hit_rate", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "completed", "failed", "duration")


def finished(url: str) -> int:
    """Requests a server has finished, whatever the reason."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "pagedllm:request_success_total"))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of one process so far (its own threads, not its children's);
    None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def gateway_layout(reqs, args, server_args: list[str], threads: int) -> dict:
    workers = []
    try:
        for i in range(2):
            workers.append(ServeProcess(f"gw-worker{i}", [*server_args, "--num-threads", str(threads)]))
        gw = Gateway([w.url for w in workers], "cache_aware")
        try:
            name = httpx.get(gw.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            before, cpu0 = [finished(w.url) for w in workers], cpu_seconds(gw.proc.pid)
            r = run_serve_bench(gw.url, name, reqs, args.request_rate, args.max_concurrency, args.seed,
                                counter_urls=[w.url for w in workers])
            per_engine = [finished(w.url) - b for w, b in zip(workers, before)]
            front_cpu = _spent(cpu0, cpu_seconds(gw.proc.pid))
        finally:
            gw.stop()
    finally:
        for w in workers:
            w.stop()
    return {"label": GATEWAY, "model": name, **{k: r[k] for k in KEYS},
            "requests_per_engine": per_engine, "threads_per_engine": [threads_used(w.text())[0] for w in workers],
            "front_cpu_s": front_cpu, "front": "the gateway process, during the run"}


def dp_layout(reqs, args, server_args: list[str]) -> dict:
    server = ServeProcess("dp2", ["--data-parallel-size", "2", "--router-policy", "prefix", *server_args])
    try:
        name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        cpu0 = cpu_seconds(server.proc.pid)
        r = run_serve_bench(server.url, name, reqs, args.request_rate, args.max_concurrency, args.seed)
        per_engine = routed_per_replica(server.url, 2)
        front_cpu = _spent(cpu0, cpu_seconds(server.proc.pid))
    finally:
        server.stop()
    return {"label": DP, "model": name, **{k: r[k] for k in KEYS},
            "requests_per_engine": per_engine, "threads_per_engine": threads_used(server.text()),
            "front_cpu_s": front_cpu, "front": "the server process during the run, not its replicas (it also tokenizes)"}


def mean_over_rounds(rows: list[dict], label: str) -> dict:
    mine = [r for r in rows if r["label"] == label]
    return {"label": label + " (mean)", **{k: sum(r[k] for r in mine) / len(mine) for k in KEYS}}


def report(rows: list[dict]) -> tuple[list[str], dict]:
    """The table (each run, then each layout's mean over the rounds), and the gateway's means
    as ratios to dp2's."""
    gw, dp = (mean_over_rounds(rows, label) for label in (GATEWAY, DP))
    lines = [f"{'layout':<41} {'out tok/s':>9} {'hit rate':>9} {'TTFT mean':>10} {'median':>8} {'P99':>8}"
             f" {'TPOT mean':>10} {'median':>7} {'P99':>7}  requests/engine  front CPU  load before"]
    for r in [*rows, gw, dp]:
        tail = (f"  {'/'.join(map(str, r['requests_per_engine'])):<15}  {r['front_cpu_s'] or 0:7.1f} s"
                f"  {r['load_average_1min_before']:.2f}" if "round" in r else "")
        lines.append(f"{_name(r):<41}"
                     f" {r['output_throughput']:9.1f} {100 * r['prefix_hit_rate']:8.1f}%"
                     f" {r['mean_ttft_ms']:8.0f}ms {r['median_ttft_ms']:6.0f}ms {r['p99_ttft_ms']:6.0f}ms"
                     f" {r['mean_tpot_ms']:8.1f}ms {r['median_tpot_ms']:5.1f}ms {r['p99_tpot_ms']:5.1f}ms{tail}")
    ratios = {k: gw[k] / dp[k] for k in ("output_throughput", "prefix_hit_rate", "mean_ttft_ms", "median_ttft_ms",
                                         "p99_ttft_ms", "mean_tpot_ms") if dp[k]}
    points = 100 * (gw["prefix_hit_rate"] - dp["prefix_hit_rate"])
    lines.append("gateway / dp2, means over the rounds of this run: "
                 + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + f"; hit rate {points:+.1f} points")
    return lines, {"gateway_mean": gw, "dp2_mean": dp, "gateway_over_dp2": ratios, "hit_rate_points": points}


def where(p: dict) -> str:
    """The result's provenance in one line, for the .txt."""
    return (f"commit {p['commit'][:12]}{' (dirty)' if p['dirty'] else ''}, torch {p['torch']}, {p['threads']} "
            f"threads in the client, {p['logical_cpus']} logical CPUs ({p['cpu']}), {p['date']}")


def _name(r: dict) -> str:
    return f"{r['label']}, round {r['round']}" if "round" in r else r["label"]


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
    p.add_argument("--rounds", type=int, default=2, help="runs of each layout, in ABBA order")
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
             f"rate {args.request_rate}; {threads} thread(s) per engine; load average before: {load_before[0]:.2f}"]
    print(lines[0], flush=True)
    runs = {GATEWAY: lambda: gateway_layout(reqs, args, server_args, threads),
            DP: lambda: dp_layout(reqs, args, server_args)}
    rows = []
    for k in range(args.rounds):  # ABBA...: neither layout always runs first, or always second
        for label in (GATEWAY, DP) if k % 2 == 0 else (DP, GATEWAY):
            load = os.getloadavg()[0]  # the other processes' share of the cores, when the machine is shared
            rows.append({**runs[label](), "round": k, "load_average_1min_before": load})
            print(f"{_name(rows[-1])}: done", flush=True)
    table, summary = report(rows)
    lines += table
    print("\n".join(table))
    command = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    save_result({"benchmark": "gateway_vs_dp", "command": command, "workload": "chat-shared-system",
                 "workload_options": opts.as_dict(), "server_args": server_args, "max_concurrency": args.max_concurrency,
                 "request_rate": args.request_rate,
                 "gateway": f"sglang-router {version('sglang-router')}, --policy cache_aware",
                 "load_average_before": load_before, "note": args.note, "rounds": args.rounds, "results": rows,
                 **summary}, args.out)
    Path(args.out).with_suffix(".txt").write_text("\n".join([f"$ {command}", where(provenance()), args.note,
                                                             *lines]) + "\n")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.txt')}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
