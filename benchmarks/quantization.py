"""Quantized weights (`--quantization gguf | int8 | int4`) against bf16: one request's decode
speed, batched throughput, and how far greedy output stays with bf16's and fp32's.

gguf runs the bundled file's own Q4_1 / Q8_0 blocks; int8 and int4 make q8_0 / q4_1 blocks
from the bf16 weights. Speed: one request (a 64-token random prompt, 256 new tokens, greedy,
EOS ignored), as BENCHMARKS §2, and 48 ShareGPT prompts cut to 256 tokens with 128 new
tokens; each engine in its own process, the four alternating for `--rounds` rounds, medians
compared.
Quality: 50 ShareGPT prompts, 64 greedy tokens, at most 4 sequences a step (decode on the
small-M paths of the block kernels, prefill on their tiled path): the mean length of the common
prefix with bf16's and with fp32's output, and how many of the 50 agree on all 64 tokens.
Perplexity of a fixed 1024-token text (ShareGPT replies, pagedllm.bench.quality), scored 8
tokens a step, through the kernels too.

    python -m benchmarks quantization --rounds 3 --out benchmarks/results/quantization.json

`--parts prefill` (alone or with speed,quality) times prefill alone, where the block kernels run
their many-row path: 16 ShareGPT prompts cut to 1,000 tokens (long ones kept, cut), one new token,
a cold pass then the median of 3 warm ones (prefix cache reset before each), each quantization in
its own process, alternating for `--rounds` rounds:

    python -m benchmarks quantization --parts prefill --out benchmarks/results/quantization_prefill.json

`--dtype float32` makes fp32 the activations and the baseline (what `dtype=auto` runs on a CPU
without native bf16, where bf16 would be a slow reference):

    python -m benchmarks quantization --parts speed --dtype float32 --rounds 2 --out benchmarks/results/quantization_avx2.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.quality import common_prefix, fixed_text_ids, perplexity
from pagedllm.bench.workloads import sharegpt_truncated

QUANTS = (None, "gguf", "int8", "int4")  # None: the float weights (bf16, or --dtype's)
LABELS = {"bfloat16": "bf16", "float32": "fp32"}   # --dtype: the activations' and the baseline's


def speed(quantization: str | None, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_model_len=2048, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tok_s": n / dt, "elapsed_s": dt, "runner": llm.engine.runner.describe()}


def prefill(quantization: str | None, prompts: list[list[int]]) -> dict:
    """Seconds of a prefill-only pass over `prompts` (one new token each): a cold pass, then the
    median of 3 warm ones, the prefix cache reset before each."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", max_model_len=2048, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for _ in range(4):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    warm = statistics.median(times[1:])
    return {"cold_s": times[0], "warm_s": warm, "prompt_tok_s": sum(map(len, prompts)) / warm,
            "runner": llm.engine.runner.describe()}


def prefill_part(rounds: int) -> list[dict]:
    prompts = [list(r.prompt) for r in sharegpt_truncated(16, 1000, 1)]
    runs: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for q in QUANTS:
            runs.setdefault(q or "bf16", []).append(in_own_process(prefill, q, prompts))
    base = statistics.median(r["prompt_tok_s"] for r in runs["bf16"])
    rows = []
    for label, rs in runs.items():
        med = statistics.median(r["prompt_tok_s"] for r in rs)
        rows.append({"workload": f"prefill, 16 ShareGPT prompts cut to 1,000 ({sum(map(len, prompts))} tokens)",
                     "engine": f"pagedllm {label}", "prompt_tok_s": med, "rounds": [r["prompt_tok_s"] for r in rs],
                     "warm_s": [r["warm_s"] for r in rs], "vs_bf16": med / base, "runner": rs[0]["runner"]})
        print(f"prefill {label:<5} {med:7.1f} prompt tok/s ({med / base:.2f}x bf16)  rounds "
              + ", ".join(f"{r['prompt_tok_s']:.1f}" for r in rs))
    return rows


def greedy(kw: dict, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(max_model_len=2048, max_num_seqs=4, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def text_perplexity(kw: dict, ids: list[int]) -> float:
    from pagedllm import LLM

    return perplexity(LLM(max_model_len=2048, max_num_batched_tokens=8, **kw), ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/quantization.json")
    ap.add_argument("--parts", default="speed,quality", help="comma list: speed, quality, prefill")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(LABELS),
                    help="the activations and the baseline (speed part)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    res: dict = {"rounds": args.rounds, "dtype": args.dtype}
    if "prefill" in parts:
        res["prefill"] = prefill_part(args.rounds)
    if "speed" in parts:
        res["results"] = speed_part(args.rounds, args.dtype)
    if "quality" in parts:
        res.update(quality_part())
    save(res, args.out)
    print(f"saved {args.out}")


def speed_part(rounds: int, dtype: str) -> list[dict]:
    label = LABELS[dtype]
    rng = random.Random(0)
    one = [[rng.randrange(0, 10000) for _ in range(64)]]
    batch = [list(r.prompt) for r in sharegpt_truncated(48, 256, 128)]
    runs: dict[str, dict[str, list[dict]]] = {"one request": {}, "48 ShareGPT prompts": {}}
    for _ in range(rounds):
        for name, prompts, max_tokens in (("one request", one, 256), ("48 ShareGPT prompts", batch, 128)):
            for q in QUANTS:
                runs[name].setdefault(q or label, []).append(in_own_process(speed, q, prompts, max_tokens, dtype))
    rows = []
    for name, by in runs.items():
        base = statistics.median(r["output_tok_s"] for r in by[label])
        for label, rs in by.items():
            med = statistics.median(r["output_tok_s"] for r in rs)
            rows.append({"workload": name, "engine": f"pagedllm {label}, {name}", "output_tok_s": med,
                         "rounds": [r["output_tok_s"] for r in rs], f"vs_{label}": med / base,
                         "runner": rs[0]["runner"]})
            each = ", ".join(f"{r['output_tok_s']:.1f}" for r in rs)
            print(f"{name:<20} {label:<5} {med:7.1f} out tok/s  ({med / base:.2f}x {label})  rounds {each}")
    return rows


def quality_part() -> dict:
    prompts = [list(r.prompt) for r in sharegpt_truncated(50, 256, 64)]
    modes = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
             **{q: {"dtype": "bfloat16", "quantization": q} for q in QUANTS if q}}
    outs = {name: in_own_process(greedy, kw, prompts, 64) for name, kw in modes.items()}
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    text = fixed_text_ids(load_tokenizer(resolve_model_dir(None)), 1024)
    ppl = {name: in_own_process(text_perplexity, kw, text) for name, kw in modes.items()}
    for name, v in ppl.items():
        print(f"perplexity of a fixed {len(text)}-token text: {name:<5} {v:.3f} ({v / ppl['bf16']:.3f}x bf16's)")
    quality = {}
    for a, b in (("bf16", "fp32"), *((q, ref) for q in QUANTS if q for ref in ("fp32", "bf16"))):
        mean, whole = common_prefix(outs[a], outs[b], 64)
        quality[f"{a}_vs_{b}"] = {"mean_common_prefix": mean, "all_64_equal": whole, "prompts": len(prompts)}
        print(f"greedy, 50 ShareGPT prompts x 64 tokens: {a} vs {b}: common prefix {mean:.1f} tokens on average, "
              f"{whole}/50 equal throughout")
    return {"quality": quality, "perplexity": {"text_tokens": len(text), **ppl}}


if __name__ == "__main__":
    main()
