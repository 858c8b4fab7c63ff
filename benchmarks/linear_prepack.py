"""F.linear on plain weights against oneDNN's linear on weights reordered once
(models/prepack.py, torch.ops.mkldnn._linear_pointwise), at every matmul shape of SmolLM2-135M
and of a TinyLlama-1.1B-shaped Llama, for M = 1 ... 256 rows, in one process, with the
machine's GEMM peak measured the same way beside them (a large square product, reordered).

    python -m benchmarks linear_prepack --dtype bfloat16 --out benchmarks/results/linear_prepack.json

--dtype int8: W8A8's whole matmul (models/w8a8.w8a8_linear on bf16 activations: quantize the
rows, multiply, scale) on the plain int8 weight (torch._int_mm) against the same on the weight
reordered once (onednn::qlinear_pointwise); the peak is the reordered int8 product's, in GOP/s.
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


def measured(model: str, name: str, m: int, n: int, k: int, plain_s: float, packed_s: float, peak: float,
             plain: str, unit: str) -> dict:
    """One shape's row of the results, printed."""
    ops = 2 * m * n * k
    r = {"model": model, "matmul": name, "n": n, "k": k, "m": m, "plain_ms": plain_s * 1e3,
         "packed_ms": packed_s * 1e3, "plain_gflops": ops / plain_s / 1e9, "packed_gflops": ops / packed_s / 1e9,
         "speedup": plain_s / packed_s, "packed_of_peak": ops / packed_s / 1e9 / peak}
    print(f"{model:<15}{name:<8} M {m:>3}: {plain} {r['plain_gflops']:6.1f} {unit}, reordered "
          f"{r['packed_gflops']:6.1f} ({r['speedup']:4.2f}x, {r['packed_of_peak']:4.0%} of peak)")
    return r


def int8_layers(n: int, k: int) -> tuple:
    """A W8A8 layer on the plain int8 weight and one on the same weight reordered."""
    import copy

    from torch import nn

    from pagedllm.models.w8a8 import pack_w8a8, set_w8a8

    plain = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    set_w8a8(plain, torch.bfloat16)
    reordered = copy.deepcopy(plain)
    pack_w8a8(reordered)
    return plain, reordered


def int8_peak(reps: int) -> float:
    from pagedllm.models.w8a8 import packed_int_matmul

    _, layer = int8_layers(2048, 2048)
    xu = torch.randint(0, 256, (2048, 2048), dtype=torch.uint8)
    return 2 * 2048**3 / median_time(lambda: packed_int_matmul(xu, layer), reps) / 1e9


def main_int8(args) -> None:
    from pagedllm.kernels import load_ops
    from pagedllm.models.w8a8 import can_pack_w8a8, w8a8_linear

    if not can_pack_w8a8():
        raise SystemExit("oneDNN's int8 kernels on reordered weights need int8 dot products (VNNI, AMX)")
    ops = load_ops()
    peak = int8_peak(5)
    print(f"int8 (W8A8, bf16 activations), {torch.get_num_threads()} threads; "
          f"int8 GEMM peak (2048^3, reordered): {peak:.0f} GOP/s")
    rows = []
    with torch.inference_mode():
        for model in args.models.split(","):
            for name, (n, k) in SHAPES[model].items():
                plain, reordered = int8_layers(n, k)
                for m in ROWS:
                    x = torch.randn(m, k).to(torch.bfloat16)
                    assert torch.equal(w8a8_linear(plain, x, ops), w8a8_linear(reordered, x, ops))
                    plain_s = median_time(lambda x=x, layer=plain: w8a8_linear(layer, x, ops), args.reps)
                    packed_s = median_time(lambda x=x, layer=reordered: w8a8_linear(layer, x, ops), args.reps)
                    rows.append(measured(model, name, m, n, k, plain_s, packed_s, peak, "plain int8", "GOP/s"))
    save({"dtype": "int8", "peak_gflops": peak, "peak_how": "median of 5 runs of a 2048x2048x2048 uint8 x int8 "
          "product, weight reordered, onednn::qlinear_pointwise", "reps": args.reps, "results": rows}, args.out)
    print(f"saved {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "int8"])
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/linear_prepack.json")
    args = ap.parse_args()
    if args.dtype == "int8":
        return main_int8(args)
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
                    plain_s = median_time(lambda x=x, w=w: F.linear(x, w), args.reps)
                    packed_s = median_time(lambda x=x, p=p: packed(x, p), args.reps)
                    rows.append(measured(model, name, m, n, k, plain_s, packed_s, peak, "F.linear", "GFLOP/s"))
    save({"dtype": args.dtype, "peak_gflops": peak, "peak_how": "median of 5 runs of a 2048x2048x2048 product, "
          "weight reordered, torch.ops.mkldnn._linear_pointwise", "reps": args.reps, "results": rows}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
