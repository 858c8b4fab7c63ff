"""int8 weights (`--quantization int8`) against bf16: one request's decode speed, batched
throughput, and how far greedy output stays with bf16's and fp32's.

Speed: one request (a 64-token random prompt, 256 new tokens, greedy, EOS ignored), as
BENCHMARKS §2, and 48 ShareGPT prompts cut to 256 tokens with 128 new tokens; each engine in
its own process, bf16 and int8 alternating for `--rounds` rounds, medians compared.
Quality: 50 ShareGPT prompts, 64 greedy tokens: the mean length of the common prefix with
bf16's and with fp32's output, and how many of the 50 agree on all 64 tokens.

    python benchmarks/quantization.py --rounds 3 --out benchmarks/results/quantization.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated


def speed(quantization: str | None, prompts: list[list[int]], max_tokens: int) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", max_model_len=2048, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tok_s": n / dt, "elapsed_s": dt, "runner": llm.engine.runner.describe()}


def greedy(kw: dict, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(max_model_len=2048, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def common_prefix(a: list[list[int]], b: list[list[int]], n: int) -> tuple[float, int]:
    same = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), n) for p, q in zip(a, b)]
    return sum(same) / len(same), sum(s == n for s in same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/quantization.json")
    args = ap.parse_args()
    rng = random.Random(0)
    one = [[rng.randrange(0, 10000) for _ in range(64)]]
    batch = [list(r.prompt) for r in sharegpt_truncated(48, 256, 128)]
    runs: dict[str, dict[str, list[dict]]] = {"one request": {}, "48 ShareGPT prompts": {}}
    for _ in range(args.rounds):
        for name, prompts, max_tokens in (("one request", one, 256), ("48 ShareGPT prompts", batch, 128)):
            for q in (None, "int8"):
                runs[name].setdefault(q or "bf16", []).append(in_own_process(speed, q, prompts, max_tokens))
    rows = []
    for name, by in runs.items():
        base = statistics.median(r["output_tok_s"] for r in by["bf16"])
        for label, rs in by.items():
            med = statistics.median(r["output_tok_s"] for r in rs)
            rows.append({"workload": name, "engine": f"pagedllm {label}, {name}", "output_tok_s": med,
                         "rounds": [r["output_tok_s"] for r in rs], "vs_bf16": med / base, "runner": rs[0]["runner"]})
            each = ", ".join(f"{r['output_tok_s']:.1f}" for r in rs)
            print(f"{name:<20} {label:<5} {med:7.1f} out tok/s  ({med / base:.2f}x bf16)  rounds {each}")
    prompts = [list(r.prompt) for r in sharegpt_truncated(50, 256, 64)]
    outs = {name: in_own_process(greedy, kw, prompts, 64) for name, kw in {
        "fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
        "int8": {"dtype": "bfloat16", "quantization": "int8"}}.items()}
    quality = {}
    for a, b in (("bf16", "fp32"), ("int8", "fp32"), ("int8", "bf16")):
        mean, whole = common_prefix(outs[a], outs[b], 64)
        quality[f"{a}_vs_{b}"] = {"mean_common_prefix": mean, "all_64_equal": whole, "prompts": len(prompts)}
        print(f"greedy, 50 ShareGPT prompts x 64 tokens: {a} vs {b}: common prefix {mean:.1f} tokens on average, "
              f"{whole}/50 equal throughout")
    save({"results": rows, "quality": quality, "rounds": args.rounds}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
