"""A decode step's matmuls as the step runs them: every layer's qkv, o, gate_up and down, then
the LM head, one after another, so each weight comes from memory (a step's weights are far
larger than the caches), for M = 1 ... 256 rows. oneDNN on weights reordered once
(torch.ops.mkldnn._linear_pointwise, the engine's bf16 kernel before §42) against ours on
weights packed in panels (kernels/csrc/bf16_panels.h), in one process, alternating, with the
machine's two limits measured beside them: the bf16 GEMM peak (a reordered 2048^3 product) and
the read bandwidth (a sum over a buffer the size of the weights).

    python -m benchmarks step_matmuls --out benchmarks/results/step_matmuls.json

Each row: ms a step, GFLOP/s and its share of the peak, the weights' bytes a second and their
share of the read bandwidth, and ours ÷ oneDNN (speed).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.lib.attention import median_time
from benchmarks.linear_prepack import SHAPES, packed, peak_gflops
from pagedllm.bench.throughput import save
from pagedllm.kernels import load_ops
from pagedllm.models.prepack import panels_wanted, to_panels

LAYERS = {"smollm2-135m": 30, "tinyllama-1.1b": 22}
ROWS = [1, 4, 8, 16, 20, 32, 64, 96, 128, 256]


def step_shapes(model: str) -> list[tuple[int, int]]:
    s = SHAPES[model]
    return [s[name] for name in ("qkv", "o", "gate_up", "down")] * LAYERS[model] + [s["lm_head"]]


def read_bandwidth(nbytes: int, reps: int) -> float:
    """Bytes a second of a sum over nbytes of floats (read once, nothing written)."""
    buf = torch.ones(nbytes // 4)
    return nbytes / median_time(buf.sum, reps)


def step_time(run, m: int, ks: set[int], reps: int) -> float:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in ks}
    return median_time(lambda: run(xs), reps)   # its first call warms primitives and pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(LAYERS))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/step_matmuls.json")
    args = ap.parse_args()
    kernels = load_ops()
    if not panels_wanted(kernels):
        raise SystemExit("this build of the CPU kernels has no AVX512-BF16: the panel kernel does not run here")
    peak = peak_gflops(torch.bfloat16, 5)
    rows = []
    for model in args.models.split(","):
        shapes = step_shapes(model)
        weights = [torch.randn(n, k).to(torch.bfloat16) * 0.02 for n, k in shapes]
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        panels = [to_panels(w) for w in weights]
        del weights
        nbytes = sum(2 * n * k for n, k in shapes)
        bandwidth = read_bandwidth(nbytes, 5)
        print(f"{model}: {len(shapes)} matmuls, {nbytes / 1e6:.0f} MB of bf16 weights; peak {peak:.0f} GFLOP/s, "
              f"read bandwidth {bandwidth / 1e9:.1f} GB/s")

        def onednn(xs):
            for p, (_, k) in zip(reordered, shapes):
                packed(xs[k], p)

        def ours(xs):
            for p, (n, k) in zip(panels, shapes):
                kernels.panel_linear(xs[k].new_empty(xs[k].shape[0], n), xs[k], p, None)

        for m in (int(r) for r in args.rows.split(",")):
            t = {name: step_time(f, m, {k for _, k in shapes}, args.reps) for name, f in (("onednn", onednn),
                                                                                         ("panels", ours))}
            flops = 2 * m * nbytes / 2
            r = {"model": model, "m": m, "weight_bytes": nbytes, "peak_gflops": peak, "read_gbs": bandwidth / 1e9,
                 "speedup": t["onednn"] / t["panels"]}
            for name, s in t.items():
                r[name] = {"ms": s * 1e3, "gflops": flops / s / 1e9, "of_peak": flops / s / 1e9 / peak,
                           "weights_gbs": nbytes / s / 1e9, "of_bandwidth": nbytes / s / bandwidth}
            rows.append(r)
            print(f"  M {m:>3}: oneDNN {r['onednn']['ms']:6.1f} ms ({r['onednn']['of_peak']:4.0%} of peak, "
                  f"{r['onednn']['of_bandwidth']:4.0%} of bandwidth)   panels {r['panels']['ms']:6.1f} ms "
                  f"({r['panels']['of_peak']:4.0%}, {r['panels']['of_bandwidth']:4.0%})   {r['speedup']:.2f}x")
    save({"benchmark": "step_matmuls", "args": vars(args), "peak_gflops": peak, "results": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
