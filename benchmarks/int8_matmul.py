"""W8A8's integer matmul on this CPU, by path, on SmolLM2-135M's shapes: oneDNN's int8 GEMM
(torch._int_mm), the same exact int32 sums through float32 sgemm in K slices of 1024
(models/w8a8.int_matmul_f32), and plain float32 sgemm of the same operands (no int8 at all,
the baseline), in one process, at the row counts a decode step and a prefill chunk take.
`int_matmul` picks the first where the CPU has VNNI or AMX-INT8, the second elsewhere; this
script shows what that choice is worth on the machine it runs on.

    python -m benchmarks int8_matmul --out benchmarks/results/int8_matmul.json
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.lib.attention import median_time
from pagedllm.bench.throughput import save
from pagedllm.models.w8a8 import cpu_has_int8_dot, int_matmul_f32

# (N, K) of SmolLM2-135M's matmuls: q/o, k/v, gate/up, down, the tied head
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = [1, 8, 64, 256]


def ms(fn, reps: int) -> float:
    return median_time(fn, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/int8_matmul.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"int8 dot products (VNNI/AMX): {cpu_has_int8_dot()}; {torch.get_num_threads()} threads")
    for n, k in SHAPES:
        wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        wf = wq.float()
        for m in ROWS:
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
            xf = xq.float()
            assert torch.equal(int_matmul_f32(xq, wq), torch._int_mm(xq, wq.t()))
            t = {"onednn_int8": ms(lambda xq=xq, wq=wq: torch._int_mm(xq, wq.t()), args.reps),
                 "f32_slices": ms(lambda xq=xq, wq=wq: int_matmul_f32(xq, wq), args.reps),
                 "f32_sgemm": ms(lambda xf=xf, wf=wf: xf @ wf.t(), args.reps)}
            rows.append({"n": n, "k": k, "m": m, **{f"{key}_ms": v for key, v in t.items()},
                         "slices_vs_onednn": t["onednn_int8"] / t["f32_slices"],
                         "slices_vs_sgemm": t["f32_sgemm"] / t["f32_slices"]})
            print(f"N {n:>5} K {k:>4} M {m:>3}: oneDNN int8 {t['onednn_int8']:8.3f} ms, f32 slices "
                  f"{t['f32_slices']:8.3f} ms ({t['onednn_int8'] / t['f32_slices']:5.2f}x oneDNN's speed, "
                  f"{t['f32_sgemm'] / t['f32_slices']:4.2f}x plain sgemm's)")
    save({"results": rows, "int8_dot": cpu_has_int8_dot(), "reps": args.reps}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
