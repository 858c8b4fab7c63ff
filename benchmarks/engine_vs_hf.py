"""Offline throughput: PagedLLM against HF transformers `generate` on the same model,
dtype, machine and ShareGPT sample, in one run. Prints ratios, writes JSON.

    python -m benchmarks engine_vs_hf --num-prompts 100 --dtype bfloat16

HF runs static batches (left padding, its contiguous KV cache) at each size in
--hf-batch-sizes; its best is the baseline. Only the output tokens each request asked
for count (HF's padding and overrun past a request's length are not credited).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from benchmarks.lib.baselines import hf_generate
from pagedllm.bench.sharegpt import sample_sharegpt
from pagedllm.bench.throughput import run_engine
from pagedllm.loader import resolve_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hf-batch-sizes", default="16,32,64")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--matmul-peak-gflops", type=float, default=None,
                    help="bf16 matmul peak of this machine (measured if omitted)")
    ap.add_argument("--out", default="results/engine_vs_hf.json")
    args = ap.parse_args()
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = sample_sharegpt(tok, args.num_prompts, args.seed, args.max_prompt_len, args.max_output_len)
    print(f"workload: {len(reqs)} ShareGPT prompts (seed {args.seed}), {sum(r.prompt_len for r in reqs)} prompt "
          f"+ {sum(r.output_len for r in reqs)} output tokens, ignore_eos, greedy, {args.dtype}")
    dtype = getattr(torch, args.dtype)

    results = [run_engine(reqs, {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                                 "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": 2048},
                          use_tqdm=False)]
    results[0].pop("steps")
    print(f"  pagedllm: {results[0]['output_tok_s']:.1f} output tok/s ({results[0]['elapsed_s']:.1f} s)")
    for bs in [int(x) for x in args.hf_batch_sizes.split(",")]:
        r = hf_generate(reqs, model_dir, args.dtype, bs)
        results.append(r)
        print(f"  {r['engine']}: {r['output_tok_s']:.1f} output tok/s ({r['elapsed_s']:.1f} s)")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    peak = args.matmul_peak_gflops or measure_matmul_gflops(dtype)
    n_params = sum(p.numel() for p in hf.parameters())
    roof = peak * 1e9 / (2 * n_params)
    ours = results[0]
    best_hf = max(results[1:], key=lambda r: r["output_tok_s"])
    print("\nsummary")
    print(f"  machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    print(f"  pagedllm output tok/s        {ours['output_tok_s']:8.1f}")
    print(f"  best HF ({best_hf['engine']})  {best_hf['output_tok_s']:8.1f}")
    print(f"  ratio pagedllm / best HF     {ours['output_tok_s'] / best_hf['output_tok_s']:8.2f}x")
    print(f"  roofline: {peak:.0f} GFLOP/s matmul / (2 x {n_params / 1e6:.0f}M FLOPs) = {roof:.0f} tok/s; "
          f"pagedllm computed {ours['computed_tok_s']:.0f} tok/s = {ours['computed_tok_s'] / roof:.0%} of it")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results, "matmul_peak_gflops": peak,
                   "roofline_tok_s": roof}, f, indent=2)
    print(f"  wrote {args.out}")


def measure_matmul_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    main()
