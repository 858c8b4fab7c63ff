"""Block size on CPU: the same ShareGPT run at each --block-sizes, each in a fresh
process: output tok/s, and the waste (eta) and KV usage the block size costs.

    python -m benchmarks block_size --block-sizes 16,32,64,128 --out benchmarks/results/block_size.json
"""
from __future__ import annotations

import argparse

from pagedllm.bench.provenance import provenance
from pagedllm.bench.throughput import in_own_process, run_engine, save
from pagedllm.bench.workloads import sharegpt_truncated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-sizes", default="16,32,64,128")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--out", default="results/block_size.json")
    args = ap.parse_args()
    reqs = sharegpt_truncated(args.num_prompts, args.max_prompt_len, args.max_output_len)
    rows = []
    print(f"{'block size':>10}{'output tok/s':>14}{'mean waste':>12}{'peak usage':>12}{'prefix hits':>13}")
    for b in [int(x) for x in args.block_sizes.split(",")]:
        r = in_own_process(run_engine, reqs, {"dtype": "bfloat16", "block_size": b, "max_model_len": 2048},
                           label=f"block size {b}", use_tqdm=False)
        r.pop("steps")
        rows.append(r)
        print(f"{b:>10}{r['output_tok_s']:>14.1f}{r['mean_waste']:>12.1%}{r['peak_kv_usage']:>12.1%}"
              f"{r['prefix_hit_rate']:>13.1%}", flush=True)
    save({"args": vars(args), "provenance": provenance(), "results": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
