"""`pagedllm env`: what this machine is and what the engine chose to run on it, for a bug report.

The CPU's features, the thread count, torch and the kernels' build; the machine's measured
limits (bf16 and int8 GEMM peaks, memory read bandwidth); and for each matmul shape of a model
the kernel the chooser picked per row range, with each candidate's GFLOP/s (kernels/chooser.py:
read from its cache when this machine measured them before, else measured now and cached).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from . import __version__
from .bench.provenance import provenance
from .kernels import cpu_kernels_available, load_ops
from .kernels.chooser import ROWS, Verdict, chooser, machine
from .loader import load_config, resolve_model_dir
from .models import ModelConfig
from .models.prepack import argmax_verdict, linear_candidates, linear_verdict
from .models.registry import decoder_for
from .models.w8a8 import Int8Weight, w8a8_candidates, w8a8_verdict
from .runtime.device import cpu_has_native_bf16


@dataclass(frozen=True)
class Shape:
    """A matmul of the model: its weight [n, k], a bias, and how many layers have it."""
    n: int
    k: int
    bias: bool
    head: bool
    count: int


def model_shapes(model: str | None) -> tuple[str, list[Shape], ModelConfig]:
    """The model's matmul shapes, read from the module it builds (on the meta device: no weights),
    and its config."""
    model_dir = resolve_model_dir(model)
    cfg = ModelConfig.from_hf(load_config(model_dir))
    with torch.device("meta"):
        net = decoder_for(cfg.model_type)(cfg, backend=None)
    seen: Counter[tuple[int, int, bool, bool]] = Counter()
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear) and not getattr(m, "router", False):
            seen[(m.out_features, m.in_features, m.bias is not None, m is net.lm_head)] += 1
    return model_dir.name, [Shape(n, k, b, h, c) for (n, k, b, h), c in seen.items()], cfg


def _best_time(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def peaks(kernels, size: int = 2048, rows: int = 1024) -> dict[str, float]:
    """GFLOP/s (GOP/s for int8) of a rows x size x size product on each path here, and the
    read bandwidth (GB/s) of a sum over 256 MiB: the limits a step's matmuls work against."""
    out: dict[str, float] = {}
    w = torch.randn(size, size) * 0.02
    x = torch.randn(rows, size)
    for c in linear_candidates(size, size, torch.bfloat16, kernels):
        layout, xb = c.layout(w.to(torch.bfloat16)), x.to(torch.bfloat16)
        out[f"bf16 {c.name}"] = 2 * rows * size * size / _best_time(lambda: c.run(layout, xb)) / 1e9
    wq = Int8Weight(torch.randint(-127, 128, (size, size), dtype=torch.int8), torch.rand(size) / 100, size)
    for c in w8a8_candidates(kernels):
        layout, xb = c.layout(wq), x.to(torch.bfloat16)
        out[f"int8 {c.name}"] = 2 * rows * size * size / _best_time(lambda: c.run(layout, xb)) / 1e9
    buf = torch.ones(64 << 20)
    out["read GB/s"] = buf.numel() * 4 / _best_time(buf.sum) / 1e9
    return out


def verdicts(shapes: list[Shape], dtype: torch.dtype, quantization: str | None, kernels,
             cfg: ModelConfig | None = None) -> list[tuple[Shape, str, Verdict]]:
    """(shape, op, verdict) for each matmul shape, as the engine would choose at load; and the
    fresh prefill chunks' attention (heads x head_dim), as the CPU backend asks at first use."""
    rows = []
    if cfg is not None and kernels is not None:
        from .attention.cpu_backend import CpuPagedAttention
        from .attention.fresh_prefill import fresh_verdict

        v = fresh_verdict(kernels, CpuPagedAttention(), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)
        rows.append((Shape(cfg.num_heads, cfg.head_dim, False, False, cfg.num_layers), "prefill attn", v))
    for s in shapes:
        if quantization == "w8a8":
            rows.append((s, "w8a8", w8a8_verdict(s.n, s.k, dtype, kernels)))
            continue
        v = linear_verdict(s.n, s.k, dtype, kernels, head=s.head)
        if v is not None:
            rows.append((s, "linear", v))
        if s.head and not s.bias and (a := argmax_verdict(s.n, s.k, dtype, kernels)) is not None:
            rows.append((s, "greedy argmax", a))
    return rows


def report(model: str | None, dtype: str, quantization: str | None, with_peaks: bool) -> dict:
    kernels_error = cpu_kernels_available()
    kernels = load_ops() if kernels_error is None else None
    torch_dtype = getattr(torch, dtype)
    name, shapes, cfg = model_shapes(model)
    mach = machine(chooser().kernels_build if kernels is not None else None)
    out = {"pagedllm": __version__, "provenance": provenance(), "machine": mach, "cpu_kernels": kernels_error or "built",
           "panel_kernel": bool(kernels is not None and kernels.has_panel_linear()),
           "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
           "forced": chooser().forced, "model": name, "dtype": dtype, "quantization": quantization}
    if with_peaks:
        out["peaks"] = peaks(kernels)
    t0 = time.perf_counter()
    chosen = verdicts(shapes, torch_dtype, quantization, kernels, cfg)
    out["choice_seconds"] = time.perf_counter() - t0
    out["cache"] = str(chooser().path_for(mach)) if chosen else None
    out["choices"] = [{"op": op, "n": s.n, "k": s.k, "layers": s.count, "head": s.head, "route": v.route.describe(),
                       "source": v.source, "rows": list(v.rows),
                       "gflops": {c: [round(g, 1) for g in v.gflops(c)] for c in v.seconds}}
                      for s, op, v in chosen]
    return out


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"PagedLLM {r['pagedllm']} (commit {r['provenance']['commit'][:12]}) · torch {m['torch']} · "
          f"{m['threads']} threads")
    print(f"CPU: {m['cpu']}")
    print(f"features: {' '.join(m['features']) or '(none of interest)'}"
          f"{'' if 'amx_tile' in m['features'] else ' · no AMX'}")
    print(f"CPU kernels: {r['cpu_kernels']} (build {m['kernels']}); bf16 panel kernel: "
          f"{'yes' if r['panel_kernel'] else 'no'}; oneDNN bf16: {'yes' if r['onednn_bf16'] else 'no'}")
    if r.get("peaks"):
        print("measured: " + ", ".join(f"{k} {v:,.0f}" if "GB/s" in k else f"{k} GEMM {v:,.0f} G{'OP' if 'int8' in k else 'FLOP'}/s"
                                       for k, v in r["peaks"].items()))
    forced = f" (PAGEDLLM_PREPACK={r['forced']} forces it where a shape can take it)" if r["forced"] else ""
    print(f"\nkernel choice for {r['model']}, {r['quantization'] or r['dtype']}{forced}; "
          f"{r['choice_seconds']:.1f} s; cache: {r['cache']}")
    print(f"{'op':<14}{'N x K':>14}{'layers':>7}  {'route':<28}GFLOP/s at rows {'/'.join(map(str, ROWS))}")
    for c in r["choices"]:
        perf = " | ".join(f"{k} {' '.join(f'{g:.0f}' for g in v)}" for k, v in c["gflops"].items()) or c["source"]
        if c["rows"] and c["rows"] != list(ROWS):
            perf += f" (at {'/'.join(map(str, c['rows']))})"
        print(f"{c['op'] + (' (head)' if c['head'] and c['op'] != 'greedy argmax' else ''):<14}"
              f"{c['n']:>7} x {c['k']:<5}{c['layers']:>6}  {c['route']:<28}{perf}")


def main(model: str | None, dtype: str, quantization: str | None, with_peaks: bool, as_json: bool) -> int:
    if dtype == "auto":   # as the engine's auto: bf16 where the CPU computes it natively
        dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    r = report(model, dtype, quantization, with_peaks)
    if as_json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r)
    return 0

