"""F.linear on plain weights against oneDNN's linear on weights reordered once
(models/prepack.py, torch.ops.mkldnn._linear_pointwise), at every matmul shape of SmolLM2-135M
and of a TinyLlama-1.1B-shaped Llama, for M = 1 ... 256 rows, in one process, with the
machine's GEMM peak measured the same way beside them (a large square product, reordered).

    python -m benchmarks linear_prepack --dtype bfloat16 --out benchmarks/results/linear_prepack.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.lib.attention import median_time
from pagedllm.bench.throughput import save
from pagedllm.models.prepack import can_prepack

# (N, K) of each model's matmuls, q/k/v and gate/up fused as the engine runs them.
SHAPES = {"smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                           "lm_head": (49152, 576)},
          "tinyllama-1.1b": {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048),
                             "down": (2048, 5632), "lm_head": (32000, 2048)}}
ROWS = [1, 8, 32, 96, 128, 256]


def packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def peak_gflops(dtype: torch.dtype, reps: int) -> float:
    """The best of a 2048^3 product, reordered: what this machine's GEMM reaches at all."""
    w = torch.randn(2048, 2048).to(dtype)
    x = torch.randn(2048, 2048).to(dtype)
    p = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return 2 * 2048**3 / median_time(lambda: packed(x, p), reps) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/linear_prepack.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not can_prepack(torch.empty(1, 1, dtype=dtype)):
        raise SystemExit(f"oneDNN cannot reorder {args.dtype} weights on this CPU")
    peak = peak_gflops(dtype, 5)
    print(f"{args.dtype}, {torch.get_num_threads()} threads; GEMM peak (2048^3, reordered): {peak:.0f} GFLOP/s")
    rows = []
    with torch.inference_mode():
        for model in args.models.split(","):
            for name, (n, k) in SHAPES[model].items():
                w = (torch.randn(n, k) * 0.02).to(dtype)
                p = torch.ops.mkldnn._reorder_linear_weight(w, None)
                for m in ROWS:
                    x = torch.randn(m, k).to(dtype)
                    flops = 2 * m * n * k
                    plain_s = median_time(lambda x=x, w=w: F.linear(x, w), args.reps)
                    packed_s = median_time(lambda x=x, p=p: packed(x, p), args.reps)
                    r = {"model": model, "matmul": name, "n": n, "k": k, "m": m, "plain_ms": plain_s * 1e3,
                         "packed_ms": packed_s * 1e3, "plain_gflops": flops / plain_s / 1e9,
                         "packed_gflops": flops / packed_s / 1e9, "speedup": plain_s / packed_s,
                         "packed_of_peak": flops / packed_s / 1e9 / peak}
                    rows.append(r)
                    print(f"{model:<15}{name:<8} M {m:>3}: F.linear {r['plain_gflops']:6.1f} GFLOP/s, reordered "
                          f"{r['packed_gflops']:6.1f} ({r['speedup']:4.2f}x, {r['packed_of_peak']:4.0%} of peak)")
    save({"dtype": args.dtype, "peak_gflops": peak, "peak_how": "median of 5 runs of a 2048x2048x2048 product, "
          "weight reordered, torch.ops.mkldnn._linear_pointwise", "reps": args.reps, "results": rows}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
