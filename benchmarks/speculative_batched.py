"""What n-gram speculative decoding does to batched throughput: the ShareGPT benchmark (96
prompts, long ones cut to 256 tokens, up to 128 new tokens, greedy, bf16, all submitted at
once), without speculation, with it (k=4), and with it turned off while 8 or more sequences
run (disable_by_batch_size=8). Each engine in its own process; ratios to the first.

    python -m benchmarks speculative_batched --out benchmarks/results/speculative_batched.json
"""
from __future__ import annotations

import argparse
import time

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated

VARIANTS = {
    "bf16": None,
    "bf16 + ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "bf16 + ngram k=4, disable_by_batch_size=8": {"method": "ngram", "num_speculative_tokens": 4,
                                                  "disable_by_batch_size": 8},
}


def run(spec: dict | None, reqs: list[tuple[list[int], int]]) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", max_model_len=2048, speculative_config=spec)
    llm.generate([{"prompt_token_ids": reqs[0][0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(temperature=0, max_tokens=n) for _, n in reqs], use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    s = llm.engine.stats()
    return {"output_tok_s": n / dt, "output_tokens": n, "elapsed_s": dt, "steps": s.steps,
            "acceptance_rate": s.spec.acceptance_rate if s.spec else None,
            "drafts": s.spec.num_drafts if s.spec else 0, "runner": llm.engine.runner.describe()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/speculative_batched.json")
    args = ap.parse_args()
    reqs = [(list(r.prompt), r.output_len) for r in sharegpt_truncated(args.num_prompts, 256, 128)]
    rows = []
    for name, spec in VARIANTS.items():
        r = in_own_process(run, spec, reqs)
        r["engine"] = f"pagedllm {name}"
        r["vs_first"] = r["output_tok_s"] / rows[0]["output_tok_s"] if rows else 1.0
        rows.append(r)
        acc = f", acceptance {r['acceptance_rate']:.0%} over {r['drafts']} drafts" if r["acceptance_rate"] is not None else ""
        print(f"{r['engine']:<48} {r['output_tok_s']:7.1f} out tok/s ({r['vs_first']:.2f}x), {r['steps']} steps{acc}")
    save({"workload": f"sharegpt {args.num_prompts} prompts cut to 256, <= 128 new tokens, greedy", "results": rows},
         args.out)


if __name__ == "__main__":
    main()
