"""Does the visualizer cost the engine anything when nobody watches? One engine, one
workload, three ways, interleaved over several rounds in one process:

  absent    no VizHub attached (engine.observers is empty)
  idle      a VizHub attached, as `pagedllm serve` does by default, with no subscriber
  watching  the hub active and recording every message (what a page costs while open)

    python -m benchmarks viz_overhead --workload chat-shared-system --num-prompts 48 --rounds 3

Prints output tok/s per mode (median over rounds) and the ratios idle/absent and
watching/absent; writes JSON.
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.bench.provenance import save_result
from pagedllm.bench.workloads import WorkloadOptions, load_workload
from pagedllm.viz.hub import VizHub


def run_once(llm: LLM, reqs, mode: str) -> tuple[float, int]:
    engine = llm.engine
    engine.observers.clear()
    hub = None
    if mode != "absent":
        hub = VizHub(engine)
        engine.observers.append(hub)
        if mode == "watching":
            hub.start_recording()
    llm.reset_prefix_cache()
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    messages = len(hub.stop_recording()) if mode == "watching" else 0
    engine.observers.clear()
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / dt, messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="chat-shared-system")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="results/viz_overhead.json")
    args = ap.parse_args()

    llm = LLM(dtype=args.dtype, max_model_len=2048)
    reqs = load_workload(args.workload, llm.tokenizer,
                         WorkloadOptions(num_prompts=args.num_prompts, max_output_len=args.max_output_len))
    run_once(llm, reqs[:8], "absent")  # warm-up: kernels for each shape are built on first use
    modes = ["absent", "idle", "watching"]
    tok_s: dict[str, list[float]] = {m: [] for m in modes}
    messages = 0
    for r in range(args.rounds):
        for m in modes[r % 3:] + modes[:r % 3]:  # rotate the order: no mode always runs first
            t, n = run_once(llm, reqs, m)
            tok_s[m].append(t)
            messages = max(messages, n)
            print(f"round {r + 1} {m:9s} {t:7.1f} output tok/s", flush=True)
    med = {m: statistics.median(v) for m, v in tok_s.items()}
    print(f"\n{args.workload}, {len(reqs)} requests, median of {args.rounds} rounds (output tok/s):")
    for m in modes:
        print(f"  {m:9s} {med[m]:7.1f}   (runs: {', '.join(f'{x:.1f}' for x in tok_s[m])})")
    print(f"idle / absent     = {med['idle'] / med['absent']:.3f}")
    print(f"watching / absent = {med['watching'] / med['absent']:.3f}  ({messages} messages recorded per run)")
    save_result({"workload": args.workload, "num_requests": len(reqs), "dtype": args.dtype,
                 "output_tok_s": tok_s, "median": med, "idle_over_absent": med["idle"] / med["absent"],
                 "watching_over_absent": med["watching"] / med["absent"]}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
