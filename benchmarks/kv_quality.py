"""Quantized KV's quality on our ShareGPT prompts: each prompt's perplexity (prompt logprobs,
every token after the first given those before it) with fp8 / int8 / int4 KV against bf16 KV,
pooled over the prompts. The whole prompt runs in one step: the CPU kernel writes a chunk's K/V
into its blocks before it attends, so even a prompt's own keys come back out of the quantized
blocks, as in decode (8 tokens a step gave the same figures to 4 digits). The CPU is in the
result's provenance: the same code should give the same figures on every CPU.

    python -m benchmarks kv_quality --out benchmarks/results/kv_quality_<cpu>.json [--num-prompts 32]
"""
from __future__ import annotations

import argparse
import math

from pagedllm.bench.throughput import save

KINDS = ("bfloat16", "fp8", "int8", "int4")


def pooled_perplexity(llm, prompts: list[list[int]]) -> float:
    from pagedllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    nll, n = 0.0, 0
    for p, o in zip(prompts, outs):
        for i, t in enumerate(p[1:], start=1):
            nll -= o.prompt_logprobs[i][t].logprob
            n += 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/kv_quality.json")
    args = ap.parse_args()
    from pagedllm import LLM
    from pagedllm.bench.workloads import sharegpt_truncated

    prompts = [list(r.prompt) for r in sharegpt_truncated(args.num_prompts, args.max_prompt_len, 1)]
    ppl = {}
    for kind in KINDS:
        llm = LLM(dtype="bfloat16", kv_cache_dtype=kind, max_model_len=2048, kv_cache_memory="512MiB",
                  enable_prefix_caching=False)
        ppl[kind] = pooled_perplexity(llm, prompts)
        llm.engine.close()
        print(f"{kind:<9} KV: perplexity {ppl[kind]:.4f} ({ppl[kind] / ppl['bfloat16'] - 1:+.2%} against bf16 KV)",
              flush=True)
    rows = [{"perplexity": ppl, "vs_bf16": {k: ppl[k] / ppl["bfloat16"] - 1 for k in KINDS}}]
    save({"benchmark": "kv_quality", "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
          "command": f"python -m benchmarks kv_quality --num-prompts {args.num_prompts} --max-prompt-len "
                     f"{args.max_prompt_len} --out {args.out}", "rows": rows}, args.out)


if __name__ == "__main__":
    main()
