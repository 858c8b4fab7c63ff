"""Offline throughput with one setting of an engine switch against another, alternately, each run in
a fresh process on the same ShareGPT requests; the ratio of the medians. --variants names two
values of the environment variable --env, baseline first. By default the float matmuls' weights
in one layout against another (PAGEDLLM_PREPACK, models/prepack.py): oneDNN's reordered weights
(onednn) against our bf16 kernel's panels (1, the default on CPUs with AVX512-BF16);
plain=0,reordered=onednn is §30's comparison (plain weights against oneDNN's reordered ones).
--env PAGEDLLM_KV_PREFETCH --variants off=0,on=1 compares the attention kernel's decode without
and with its prefetch of the keys (§43).

    python -m benchmarks prepack_ab --rounds 2 --out benchmarks/results/prepack_ab.json
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.throughput import in_own_process, run_engine, save
from pagedllm.bench.workloads import sharegpt_truncated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--env", default="PAGEDLLM_PREPACK", help="the environment variable the variants set")
    ap.add_argument("--variants", default="onednn=onednn,panels=1", help="name=value,name=value (baseline first)")
    ap.add_argument("--out", default="benchmarks/results/prepack_ab.json")
    args = ap.parse_args()
    reqs = sharegpt_truncated(args.num_prompts, args.max_prompt_len, args.max_output_len)
    kwargs = {"dtype": args.dtype, "max_model_len": 2048}
    variants = [tuple(v.split("=", 1)) for v in args.variants.split(",")]
    if len(variants) != 2:
        raise SystemExit("--variants: two name=value pairs, the baseline first")
    (base, _), (new, _) = variants
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for _ in range(args.rounds):
        for name, env in variants:
            r = in_own_process(run_engine, reqs, kwargs, label=f"pagedllm, {name}", use_tqdm=False,
                               env={args.env: env})
            runs[name].append(r)
            print(f"{r['engine']:<32}{r['output_tok_s']:8.1f} output tok/s warm, "
                  f"{r['cold']['output_tok_s']:8.1f} cold")
    med = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
    cold = {k: statistics.median(r["cold"]["output_tok_s"] for r in v) for k, v in runs.items()}
    print(f"{new} / {base}: warm {med[new] / med[base]:.2f}x ({med[new]:.1f} / "
          f"{med[base]:.1f}), cold {cold[new] / cold[base]:.2f}x")
    save({"args": vars(args), "median_warm": med, "median_cold": cold,
          "warm_ratio": med[new] / med[base], "cold_ratio": cold[new] / cold[base],
          "results": [r for v in runs.values() for r in v]}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
