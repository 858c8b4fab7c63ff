"""What the greedy LM head saves: a greedy row whose logits nobody reads takes its token from the
head's argmax kernel (kernels/csrc/bf16_panels.h: gemm_argmax), which keeps each panel's best per
row instead of writing rows x vocabulary bf16 logits and reading them back (panel_linear, then
argmax_rows). Two measurements, each against its baseline in the same process:

- the head alone, from memory as a step meets it (a fresh output each call, as the engine
  allocates one): linear + argmax against the kernel, for SmolLM2-135M's head (49,152 x 576) and
  Gemma 3's (262,144 x 640) at a decode step's rows;
- steady decode steps of ShareGPT requests (prompts cut to 256 tokens), the engine's own
  steps, the two heads alternating every --steps steps for --rounds rounds.

    python -m benchmarks greedy_head --out benchmarks/results/greedy_head.json

The Gemma rows need its bf16 safetensors (`python -m benchmarks gemma3 --parts vllm` writes them);
without them only SmolLM2's run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.lib.attention import median_time
from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import save
from pagedllm.bench.workloads import sharegpt_truncated
from pagedllm.kernels import load_ops
from pagedllm.models.prepack import panels_wanted, to_panels

GEMMA_BF16 = Path.home() / ".cache/pagedllm/gemma-3-270m-bf16"
HEADS = {"smollm2-135m": (49152, 576), "gemma3-270m": (262144, 640)}


def head_alone(kernels, n: int, k: int, rows: int, reps: int) -> dict:
    p = to_panels((torch.randn(n, k) * 0.02).to(torch.bfloat16))
    x = torch.randn(rows, k).to(torch.bfloat16)

    def full():
        out = x.new_empty(rows, n)
        kernels.panel_linear(out, x, p, None)
        return kernels.argmax_rows(out)

    assert torch.equal(full(), kernels.panel_argmax(x, p, n))
    t_full = median_time(full, reps)
    t_argmax = median_time(lambda: kernels.panel_argmax(x, p, n), reps)
    return {"rows": rows, "linear_argmax_ms": t_full * 1e3, "argmax_kernel_ms": t_argmax * 1e3,
            "speedup": t_full / t_argmax}


def decode_steps(model: str | None, batch: int, steps: int, rounds: int) -> dict:
    reqs = sharegpt_truncated(batch, 256, 1000, fixed_output_len=1000)
    llm = LLM(dtype="bfloat16", max_model_len=2048, **({"model": model} if model else {}))
    eng = llm.engine
    net = eng.runner.model
    fused = net.greedy_tokens
    for i, r in enumerate(reqs):
        eng.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0))
    while eng.scheduler.waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()   # every prompt in, then steady decode steps only
    times: dict[str, list[float]] = {"full head": [], "argmax kernel": []}
    for _ in range(rounds):
        for name in times:   # alternating: contexts grow through the run, both heads see the same
            net.greedy_tokens = fused if name == "argmax kernel" else (lambda h: None)
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    net.greedy_tokens = fused
    eng.close()
    full, kernel = (statistics.median(v) for v in times.values())
    return {"batch": batch, "step_ms": times, "median_full_ms": full, "median_kernel_ms": kernel,
            "speedup": full / kernel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,32,96")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/greedy_head.json")
    args = ap.parse_args()
    kernels = load_ops()
    if not panels_wanted(kernels):
        raise SystemExit("this build of the CPU kernels has no AVX512-BF16: the argmax kernel does not run here")
    result: dict = {"head_alone": {}, "decode_steps": {}}
    for name, (n, k) in HEADS.items():
        result["head_alone"][name] = [head_alone(kernels, n, k, int(m), 10) for m in args.rows.split(",")]
        for r in result["head_alone"][name]:
            print(f"{name} head, {r['rows']} rows: linear + argmax {r['linear_argmax_ms']:.2f} ms, "
                  f"argmax kernel {r['argmax_kernel_ms']:.2f} ms ({r['speedup']:.2f}x)")
    runs = [("smollm2-135m", None, 96)] + ([("gemma3-270m", str(GEMMA_BF16), 32)] if GEMMA_BF16.is_dir() else [])
    for name, model, batch in runs:
        r = result["decode_steps"][name] = decode_steps(model, batch, args.steps, args.rounds)
        print(f"{name}, {batch} sequences decoding: full head {r['median_full_ms']:.1f} ms a step, argmax kernel "
              f"{r['median_kernel_ms']:.1f} ms ({r['speedup']:.2f}x)")
    result["args"] = vars(args)
    save(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
