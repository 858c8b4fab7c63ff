"""`pagedllm bench dp`: data-parallel serving side by side, one run, one workload.

For each layout (replicas x router policy) a real `pagedllm serve` starts on 127.0.0.1,
the workload goes through the HTTP API (bench serve's client), and the server stops. What
is recorded: output tok/s, the run's prefix hit rate (the server's own counters), how
many requests each replica got, and the threads each replica ran.
"""
from __future__ import annotations

import logging
import re
import shlex
import sys
from dataclasses import dataclass

import httpx

from .process import LoggedProcess
from pagedllm.bench.serve_client import run_serve_bench
from pagedllm.bench.sharegpt import BenchRequest
from pagedllm.util import free_port


@dataclass(frozen=True, slots=True)
class Layout:
    replicas: int
    policy: str

    @property
    def label(self) -> str:
        return f"dp{self.replicas}-{self.policy}"


def parse_layouts(text: str) -> list[Layout]:
    """'1:prefix,2:prefix,2:round-robin' -> layouts."""
    from pagedllm.config import ROUTER_POLICIES

    out = []
    for item in (x for x in text.split(",") if x):
        n, _, policy = item.partition(":")
        if not n.isdigit() or int(n) < 1 or (policy or "prefix") not in ROUTER_POLICIES:
            raise ValueError(f"layouts: {item!r} is not REPLICAS:POLICY (REPLICAS >= 1, POLICY one of "
                             f"{ROUTER_POLICIES})")
        out.append(Layout(int(n), policy or "prefix"))
    if not out:
        raise ValueError("layouts: none given")
    return out


class ServeProcess(LoggedProcess):
    """A `pagedllm serve` subprocess on 127.0.0.1 with `args`, up once /health answers."""

    def __init__(self, label: str, args: list[str], timeout: float = 600) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(f"pagedllm-{label}", [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(self.port),
                                               "--no-viz", "--log-interval", "5", *args])
        self.wait_until(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200, timeout,
                        f"pagedllm serve ({label}) coming up")


def threads_used(log: str) -> list[int]:
    """The CPU threads each engine of a server's log said it runs."""
    return [int(t) for t in re.findall(r"CPU: (\d+) threads", log)]


def routed_per_replica(url: str, replicas: int) -> list[int]:
    """Requests the data-parallel server sent each replica ([] for one replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    if replicas == 1:
        return []
    counts = [0] * replicas
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "pagedllm:replica_routed_requests_total":
                counts[int(s.labels["replica"])] = int(s.value)
    return counts


def run_layout(layout: Layout, reqs: list[BenchRequest], server_args: list[str], rate: float,
               concurrency: int | None, seed: int) -> dict:
    server = ServeProcess(layout.label, ["--data-parallel-size", str(layout.replicas), "--router-policy",
                                         layout.policy, *server_args])
    try:
        name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = run_serve_bench(server.url, name, reqs, rate, concurrency, seed)
        routed = routed_per_replica(server.url, layout.replicas)
    finally:
        server.stop()
    threads = threads_used(server.text())
    return {"label": layout.label, "replicas": layout.replicas, "router_policy": layout.policy,
            "output_tok_s": r["output_throughput"], "prefix_hit_rate": r["prefix_hit_rate"],
            "completed": r["completed"], "failed": r["failed"], "duration_s": r["duration"],
            "mean_ttft_ms": r["mean_ttft_ms"], "mean_tpot_ms": r["mean_tpot_ms"],
            "total_output_tokens": r["total_output_tokens"], "routed_per_replica": routed,
            "threads_per_replica": threads, "errors": r["errors"][:5]}


def run_dp_bench(layouts: list[Layout], reqs: list[BenchRequest], server_args: list[str],
                 rate: float = float("inf"), concurrency: int | None = None, seed: int = 0) -> list[dict]:
    rows = []
    for layout in layouts:
        print(f"{layout.label}: starting {layout.replicas} replica(s)...", flush=True)
        rows.append(run_layout(layout, reqs, server_args, rate, concurrency, seed))
        print_row(rows[-1], rows[0])
    return rows


def print_row(r: dict, base: dict) -> None:
    """One layout's figures, its throughput also as a ratio to the first layout's (same command)."""
    routed = "/".join(map(str, r["routed_per_replica"])) or "-"
    ratio = r["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else float("nan")
    print(f"{r['label']:<18} {r['output_tok_s']:8.1f} out tok/s ({ratio:.2f}x {base['label']})   hit rate {100 * r['prefix_hit_rate']:5.1f}%   "
          f"TTFT {r['mean_ttft_ms']:8.0f} ms   TPOT {r['mean_tpot_ms']:6.1f} ms   routed {routed}   "
          f"threads/replica {r['threads_per_replica']}   failed {r['failed']}", flush=True)


def add_parser(bs, workload_args, opts, tokenizer) -> None:
    """`pagedllm bench dp` (workload_args, opts, tokenizer: bench.cli's helpers)."""
    d = bs.add_parser("dp", help="data-parallel serving: 1 replica vs N with prefix and round-robin routing, "
                      "over HTTP")
    workload_args(d, num_prompts=48)
    d.set_defaults(workload="chat-shared-system", num_system_prompts=8, max_output_len=64)
    d.add_argument("--model", default=None, help="model served and tokenizer of the workload (default model)")
    d.add_argument("--layouts", default="1:prefix,2:prefix,2:round-robin",
                   help="comma list of REPLICAS:ROUTER_POLICY, each served and measured in turn")
    d.add_argument("--server-args", default="--dtype float32 --kv-cache-memory 256MiB --max-model-len 2048",
                   help="more `pagedllm serve` flags, one string (each replica gets its own KV pool of "
                        "--kv-cache-memory)")
    d.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals; inf sends them all at once")
    d.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (None: no cap)")
    d.add_argument("--out", default="results/data_parallel.json", help="result JSON")
    d.set_defaults(func=lambda a: _main(a, opts, tokenizer))


def _main(a, opts, tokenizer) -> int:
    from pagedllm.bench.provenance import save_result
    from pagedllm.bench.workloads import load_workload

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table
    try:
        layouts = parse_layouts(a.layouts)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    server_args = shlex.split(a.server_args) + (["--model", a.model] if a.model else [])
    reqs = load_workload(a.workload, tokenizer(a.model), opts(a))
    print(f"workload: {a.workload}, {len(reqs)} requests, {a.num_system_prompts} system prompt(s), mean prompt "
          f"{sum(r.prompt_len for r in reqs) / len(reqs):.0f} tokens, mean output "
          f"{sum(r.output_len for r in reqs) / len(reqs):.0f} tokens")
    rows = run_dp_bench(layouts, reqs, server_args, a.request_rate, a.max_concurrency, a.seed)
    command = "python -m benchmarks " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    save_result({"benchmark": "data_parallel", "command": command, "workload": a.workload,
                 "workload_options": opts(a).as_dict(), "server_args": server_args, "results": rows}, a.out)
    print(f"wrote {a.out}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
