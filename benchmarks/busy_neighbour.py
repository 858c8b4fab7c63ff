"""A busy neighbour: the same ShareGPT run quiet, then beside `yes > /dev/null` (one core
kept busy), with the thread governor on (the default) and off (PAGEDLLM_ADAPT_THREADS=0:
the engine keeps one thread per core whatever happens), then beside the same loop at
`nice -n 19` (background work the kernel gives way to: the governor should not). Each run
in a fresh process. Issue 38's bars: >= 0.5 of quiet beside the busy loop, >= 0.9 beside
the niced one.

    python -m benchmarks busy_neighbour --out benchmarks/results/busy_neighbour.json
"""
from __future__ import annotations

import argparse
import subprocess

from pagedllm.bench.provenance import provenance
from pagedllm.bench.throughput import in_own_process, run_engine, save
from pagedllm.bench.workloads import sharegpt_truncated


def run(reqs, adapt: bool) -> dict:
    r = in_own_process(run_engine, reqs, {"dtype": "bfloat16", "max_model_len": 2048}, use_tqdm=False,
                       env={"PAGEDLLM_ADAPT_THREADS": "1" if adapt else "0"})
    r.pop("steps")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--out", default="results/busy_neighbour.json")
    args = ap.parse_args()
    reqs = sharegpt_truncated(args.num_prompts, args.max_prompt_len, args.max_output_len)
    rows = {"quiet": run(reqs, adapt=True)}
    busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    try:
        rows["busy neighbour, governor on"] = run(reqs, adapt=True)
        rows["busy neighbour, governor off"] = run(reqs, adapt=False)
    finally:
        busy.kill()
        busy.wait()
    niced = subprocess.Popen(["nice", "-n", "19", "yes"], stdout=subprocess.DEVNULL)
    try:
        rows["niced neighbour (nice 19), governor on"] = run(reqs, adapt=True)
    finally:
        niced.kill()
        niced.wait()
    quiet = rows["quiet"]["output_tok_s"]
    for name, r in rows.items():
        print(f"{name:<40}{r['output_tok_s']:8.1f} output tok/s  {r['output_tok_s'] / quiet:6.2f} of quiet "
              f"(cold pass {r['cold']['output_tok_s']:.1f})")
    save({"args": vars(args), "provenance": provenance(), "results": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
