"""What --batch-invariant costs: output tok/s with the mode off and on, side by side in one
command, each run in a fresh process, alternating for --rounds rounds (medians reported:
the machine is shared). Two workloads, bf16: a ShareGPT batch (truncated prompts) and one
long request decoding alone (where the mode's attention no longer splits the context across
threads). Three variants: off; on (AMX matmuls where the CPU has AMX); and
on with the fallback forced (oneDNN on 32-row tiles: what fp32, fp16 or a CPU without AMX
runs).

--match also counts, for the mode off and on, how many of --match-prompts greedy requests
run in one batch under a KV pool small enough to preempt give the same tokens as alone.

    python -m benchmarks batch_invariant --match --out benchmarks/results/batch_invariant.json
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.bench.provenance import provenance
from pagedllm.bench.sharegpt import BenchRequest
from pagedllm.bench.throughput import in_own_process, run_engine, save
from pagedllm.bench.workloads import sharegpt_truncated

ENGINE = {"dtype": "bfloat16", "max_model_len": 2048}
VARIANTS = ("off", "on", "on, 32-row tiles")


def run_variant(reqs: list[BenchRequest], variant: str) -> dict:
    """run_engine in this (fresh) process with the mode off, on, or on without AMX."""
    if variant == "on, 32-row tiles":
        import pagedllm.models.batch_invariant as bi
        bi.can_pack = lambda weight, kernels: False  # every matmul takes the tiled fallback
    r = run_engine(reqs, {**ENGINE, "batch_invariant": variant != "off"}, use_tqdm=False, label=variant)
    r.pop("steps")
    return r


def match_count(reqs: list[BenchRequest], on: bool, max_tokens: int, num_blocks: int) -> dict:
    """Greedy tokens of every request in one batch (a pool of num_blocks blocks: preemption)
    against the same request run alone in the same engine."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", num_gpu_blocks_override=num_blocks, max_num_batched_tokens=256,
              max_model_len=2048, batch_invariant=on)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [r.prompt for r in reqs]
    batch = llm.generate(prompts, sp, use_tqdm=False)
    st = llm.get_stats()
    alone = []
    for p in prompts:
        llm.reset_prefix_cache()  # truly alone: nothing the batch computed is reused
        alone.append(llm.generate([p], sp, use_tqdm=False)[0])
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(alone, batch))
    return {"batch_invariant": on, "identical": same, "requests": len(reqs), "preemptions": st.preemptions,
            "prefix_hits": st.kv.prefix_hits, "max_tokens": max_tokens, "num_blocks": num_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--single-prompt-len", type=int, default=1024, help="the lone request's prompt (truncated)")
    ap.add_argument("--single-output-len", type=int, default=128, help="tokens the lone request decodes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--match", action="store_true", help="also count batch-vs-alone identical requests")
    ap.add_argument("--match-prompts", type=int, default=32)
    ap.add_argument("--out", default="results/batch_invariant.json")
    args = ap.parse_args()
    t_start = time.perf_counter()
    workloads = {
        "sharegpt": sharegpt_truncated(args.num_prompts, args.max_prompt_len, args.max_output_len),
        # The longest of 20 prompts, cut to --single-prompt-len.
        "one request": [max(sharegpt_truncated(20, args.single_prompt_len, args.single_output_len,
                                               fixed_output_len=args.single_output_len), key=lambda r: r.prompt_len)],
    }
    runs: dict[str, dict[str, list[dict]]] = {w: {v: [] for v in VARIANTS} for w in workloads}
    for _ in range(args.rounds):
        for w, reqs in workloads.items():
            for v in VARIANTS:
                runs[w][v].append(in_own_process(run_variant, reqs, v))
    table = []
    for w, by_variant in runs.items():
        off = statistics.median(r["output_tok_s"] for r in by_variant["off"])
        for name, rs in by_variant.items():
            tok_s = statistics.median(r["output_tok_s"] for r in rs)
            table.append({"workload": w, "mode": name, "output_tok_s": tok_s, "of_off": tok_s / off,
                          "rounds": [r["output_tok_s"] for r in rs], "runner": rs[0]["runner"]})
    n, p = args.num_prompts, args.max_prompt_len
    one = workloads["one request"][0]
    print(f"sharegpt: {n} prompts truncated to {p} tokens, outputs <= {args.max_output_len}; one request: "
          f"{one.prompt_len}-token prompt, {one.output_len} tokens; bf16, median of {args.rounds} alternating rounds")
    print(f"{'workload':<14}{'batch-invariant':<22}{'output tok/s':>13}{'vs off':>8}   rounds")
    for t in table:
        print(f"{t['workload']:<14}{t['mode']:<22}{t['output_tok_s']:>13.1f}{t['of_off']:>8.2f}   "
              + ", ".join(f"{x:.1f}" for x in t["rounds"]))
    matches = []
    if args.match:
        reqs = sharegpt_truncated(args.match_prompts, 700, 32)
        for on in (False, True):
            m = in_own_process(match_count, reqs, on, 24, 120)
            matches.append(m)
            print(f"greedy, {m['requests']} ShareGPT prompts (<= 700 tokens) in one batch ({m['preemptions']} "
                  f"preemptions) vs each alone, mode {'on' if on else 'off'}: {m['identical']}/{m['requests']} "
                  f"identical")
    print(f"({time.perf_counter() - t_start:.0f} s; {table[0]['runner']})")
    save({"args": vars(args), "provenance": provenance(), "engine": ENGINE, "throughput": table,
          "match": matches, "runs": runs}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
