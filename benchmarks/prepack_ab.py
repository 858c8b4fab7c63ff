"""Offline throughput with settings of an engine switch against one another, alternately, each run
in a fresh process on the same ShareGPT requests; the ratio of the medians to the first. --variants
names values of the environment variable --env, baseline first. By default the float matmuls'
paths (PAGEDLLM_PREPACK, models/prepack.py): the chooser's verdicts (the default, measured on this
machine) against each path forced (panels, onednn); the target is the default at >= 0.95x the
best forced path. plain=0,reordered=onednn is §30's comparison (plain weights against oneDNN's
reordered ones). --env PAGEDLLM_KV_PREFETCH --variants off=0,on=1 compares the attention kernel's
decode without and with its prefetch of the keys (§43). --shape tinyllama-1.1b runs the 1.1B
Llama shape (random weights, written once under ~/.cache/pagedllm/shapes/).

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
    ap.add_argument("--variants", default="default=1,panels=panels,onednn=onednn",
                    help="name=value,... (baseline first)")
    ap.add_argument("--shape", default=None, help="a random-weight shape of pagedllm.bench.shapes (default: SmolLM2)")
    ap.add_argument("--quantization", default=None, help="e.g. w8a8")
    ap.add_argument("--out", default="benchmarks/results/prepack_ab.json")
    args = ap.parse_args()
    reqs = sharegpt_truncated(args.num_prompts, args.max_prompt_len, args.max_output_len)
    kwargs = {"dtype": args.dtype, "max_model_len": 2048, "quantization": args.quantization}
    if args.shape:
        from pagedllm.bench.shapes import make_model

        kwargs["model"] = str(make_model(args.shape, f"~/.cache/pagedllm/shapes/{args.shape}"))
    variants = [tuple(v.split("=", 1)) for v in args.variants.split(",")]
    if len(variants) < 2:
        raise SystemExit("--variants: two or more name=value pairs, the baseline first")
    base = variants[0][0]
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
    for name in list(runs)[1:]:
        print(f"{base} / {name}: warm {med[base] / med[name]:.2f}x ({med[base]:.1f} / {med[name]:.1f}), "
              f"cold {cold[base] / cold[name]:.2f}x")
    best = max(list(runs)[1:], key=lambda k: med[k])
    print(f"{base} / the best of the others ({best}): warm {med[base] / med[best]:.2f}x")
    save({"args": vars(args), "median_warm": med, "median_cold": cold,
          "warm_ratio_to_best_other": med[base] / med[best], "best_other": best,
          "warm_ratios": {k: med[base] / med[k] for k in list(runs)[1:]},
          "results": [r for v in runs.values() for r in v]}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
