"""Serving, side by side: `pagedllm serve` and `vllm serve` (vLLM's CPU backend, in its
own venv), each driven by our client (`pagedllm bench serve`) and by vLLM's own
(`vllm bench serve`), at the same request rates, one server at a time.

    python -m benchmarks serve_vs_vllm --rates 1,2,4,inf --num-prompts 64 \\
        --out benchmarks/results/serve_vs_vllm.json

Workload: random token ids, --input-len in, --output-len out, ignore_eos (vLLM's random
dataset; our client draws its own ids of the same lengths). Both servers get the same KV
budget and max_model_len. Each server first serves 8 warm-up requests. Needs the vLLM
venv (`python -m benchmarks compare --setup-vllm` creates it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pagedllm.bench.provenance import provenance
from pagedllm.bench.serve_client import run_serve_bench
from benchmarks.lib.vllm_baseline import VllmServer, stop_process, vllm_bench_serve, vllm_python, wait_healthy
from pagedllm.bench.workloads import WorkloadOptions, load_workload
from pagedllm.config import parse_bytes
from pagedllm.loader import load_tokenizer, resolve_model_dir
from pagedllm.util import free_port

MODEL = "SmolLM2-135M-Instruct"




class PagedServer:
    def __init__(self, port: int, kv: str, max_model_len: int, log_path: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port), "--kv-cache-memory", kv,
             "--max-model-len", str(max_model_len), "--dtype", "bfloat16", "--no-viz"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.url, self.proc, timeout=600)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def ours(url: str, tok, args, rate: float) -> dict:
    reqs = load_workload("random", tok, WorkloadOptions(num_prompts=args.num_prompts, seed=args.seed,
                                                        input_len=args.input_len, output_len=args.output_len,
                                                        max_output_len=args.output_len))
    return _summary(run_serve_bench(url, MODEL, reqs, rate, None, args.seed))


def theirs(python: Path, url: str, model_dir: Path, args, rate: float) -> dict:
    return _summary(vllm_bench_serve(python, url, MODEL, model_dir, args.num_prompts, args.input_len,
                                     args.output_len, rate, args.seed))


def _summary(r: dict) -> dict:
    """Both clients write vLLM's flat keys: keep the same few of each."""
    keys = {f"{s}_{k}_ms": r.get(f"{s}_{k}_ms") for k in ("ttft", "tpot", "itl") for s in ("mean", "median", "p99")}
    return {"output_throughput": r["output_throughput"], "request_throughput": r["request_throughput"],
            "completed": r["completed"], "failed": r.get("failed", 0), **keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,4,inf")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--servers", default="pagedllm,vllm")
    ap.add_argument("--clients", default="pagedllm,vllm")
    ap.add_argument("--vllm-venv", default=None)
    ap.add_argument("--out", default="results/serve_vs_vllm.json")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    model_dir = resolve_model_dir(None)
    tok = load_tokenizer(model_dir)
    python, why = vllm_python(Path(args.vllm_venv) if args.vllm_venv else None)
    if python is None:
        raise SystemExit(why)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows = []
    for server in args.servers.split(","):
        port = free_port()
        log = os.path.splitext(args.out)[0] + f".{server}-server.log"
        srv = (PagedServer(port, args.kv_cache_memory, args.max_model_len, log) if server == "pagedllm" else
               VllmServer(python, model_dir, port, parse_bytes(args.kv_cache_memory), args.max_model_len, log))
        try:
            warm = argparse.Namespace(**{**vars(args), "num_prompts": 8})
            ours(srv.url, tok, warm, float("inf"))
            for rate in rates:
                for client in args.clients.split(","):
                    r = ours(srv.url, tok, args, rate) if client == "pagedllm" else \
                        theirs(python, srv.url, model_dir, args, rate)
                    r.update(server=server, client=client, request_rate=rate)
                    rows.append(r)
                    print(f"server {server:<9} client {client:<9} rate {rate:>4}: {r['output_throughput']:7.1f} "
                          f"output tok/s, mean TTFT {r['mean_ttft_ms']:8.1f} ms, TPOT {r['mean_tpot_ms']:7.1f} ms, "
                          f"ITL {r['mean_itl_ms']:7.1f} ms, {r['completed']} ok / {r['failed']} failed", flush=True)
                    with open(args.out, "w") as f:  # after every run: a crash keeps what was measured
                        json.dump({"args": vars(args), "provenance": provenance(), "results": rows}, f, indent=1)
        finally:
            srv.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
