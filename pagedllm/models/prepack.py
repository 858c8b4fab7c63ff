"""Float matmul weights reordered once at load, for the kernel that multiplies them, chosen on
this machine by timing (kernels/chooser.py).

Two kernels compute a float layer's product from a reordered weight:
- bf16 weights in panels of 32 output columns for our own kernel (kernels/csrc/bf16_panels.h),
  where the CPU kernels were built with AVX512-BF16. On a 2-core AMD Zen 4 (no AMX), weights
  read from memory, it ran 1.67x oneDNN's reordered matmul at one row, 1.5x at 20 rows and 1.1x
  at 96 (BENCHMARKS.md section 42), and a row's result does not depend on the rows beside it.
- oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what torch's own compiler
  does for frozen CPU graphs), bf16 or fp32. `F.linear` hands oneDNN a plain [out, in] weight on
  every call, and oneDNN reorders it before it multiplies: at decode batch sizes that reorder
  costs as much as the matmul; reordered once the same products ran 1.26-3.2x faster at one row
  (section 30). Where the CPU has AMX, oneDNN's bf16 GEMM runs on it: on an Intel Xeon with AMX
  it ran 3.5-5.4x our panels (issue 58).

Which one runs is measured, per weight shape and row range, at first load on a machine
(`linear_verdict`), and cached; a weight is kept in the second layout too only where that
layout wins a row range by more than chooser.SECOND_LAYOUT_GAIN. The results are the same
numbers up to the order of the additions.

The plain weight is then dropped (a layer keeps its reordered copies), except where it is
shared with the input embedding (tied LM heads), which still looks rows up in it.
PAGEDLLM_PREPACK=0 keeps plain weights; =panels or =onednn forces that path wherever a weight
can take it (for comparisons: benchmarks/prepack_ab.py).
"""
from __future__ import annotations

import math
import os

import torch
from torch import nn

from ..kernels.chooser import ROWS, SECOND_LAYOUT_GAIN, Candidate, Route, Verdict, chooser, dtype_name

PACKED_DTYPES = (torch.bfloat16, torch.float32)
PANEL = 32  # output columns of a panel (bf16_panels.h)


def prepack_wanted() -> bool:
    """PAGEDLLM_PREPACK=0 keeps plain weights (for comparisons: benchmarks/linear_prepack.py)."""
    return os.environ.get("PAGEDLLM_PREPACK", "1").strip() != "0"


def panels_wanted(kernels) -> bool:
    """Our panel kernel is a candidate for bf16 weights: it is built (AVX512-BF16) and not turned
    off (PAGEDLLM_PREPACK=onednn)."""
    return kernels is not None and os.environ.get("PAGEDLLM_PREPACK", "1").strip() != "onednn" \
        and kernels.has_panel_linear()


def panels_shape(n: int, k: int) -> tuple[int, int, int, int]:
    return -(-n // PANEL), k // 2, PANEL, 2


def to_panels(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] (K even) as bf16_panels.h reads it: [..., ceil(N / 32), K / 2, 32, 2], N padded
    with zero columns."""
    *lead, n, k = w.shape
    if n % PANEL:
        w = torch.cat([w, w.new_zeros(*lead, PANEL - n % PANEL, k)], dim=-2)
    return w.reshape(*lead, -1, PANEL, k // 2, 2).transpose(-3, -2).contiguous()


def from_panels(p: torch.Tensor, n: int) -> torch.Tensor:
    """to_panels' [..., P, K / 2, 32, 2] back to [..., n, K]."""
    *lead, np_, k2, _, _ = p.shape
    return p.transpose(-3, -2).reshape(*lead, np_ * PANEL, 2 * k2)[..., :n, :]


def onednn_takes(dtype: torch.dtype) -> bool:
    """oneDNN has a reordered CPU matmul for this dtype here."""
    return dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available() \
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and onednn_takes(weight.dtype)


def _onednn_layout(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def _onednn(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def linear_candidates(n: int, k: int, dtype: torch.dtype, kernels, panels_ok: bool = True) -> list[Candidate]:
    """The paths that compute x @ W^T for a [n, k] weight of `dtype` here: our panels (bf16,
    K even, the kernels built with AVX512-BF16; panels_ok: the layer's bias is one they read),
    oneDNN on the reordered weight."""
    out = []
    if panels_ok and dtype == torch.bfloat16 and k % 2 == 0 and panels_wanted(kernels):
        out.append(Candidate("panels", to_panels,
                             lambda p, x: kernels.panel_linear(x.new_empty(x.shape[0], n), x, p, None)))
    if onednn_takes(dtype):
        out.append(Candidate("onednn", _onednn_layout, _onednn))
    return out


def argmax_candidates(n: int, k: int, dtype: torch.dtype, kernels) -> list[Candidate]:
    """The paths that give argmax(x @ W^T) a row: the panels' argmax kernel (no logits
    written), or oneDNN's product and torch's argmax over it."""
    out = []
    if dtype == torch.bfloat16 and k % 2 == 0 and panels_wanted(kernels):
        out.append(Candidate("panels", to_panels, lambda p, x: kernels.panel_argmax(x, p, n)))
    if onednn_takes(dtype):
        out.append(Candidate("onednn", _onednn_layout, lambda p, x: _onednn(p, x).argmax(dim=-1)))
    return out


def _verdict(op: str, cands: list[Candidate], n: int, k: int, dtype: torch.dtype, rows=ROWS,
             gain: float = SECOND_LAYOUT_GAIN) -> Verdict:
    return chooser().choose(op, (n, k, dtype.itemsize), 2 * n * k, cands,
                            lambda g: (torch.randn(n, k, generator=g) * 0.02).to(dtype), n * k * dtype.itemsize,
                            lambda m: torch.randn(m, k).to(dtype), rows, gain, sources=("panel_linear.cpp",))


HEAD_ROWS = ROWS[:-1]   # the LM head runs on sampled rows only: at most a decode batch


def linear_verdict(n: int, k: int, dtype: torch.dtype, kernels, panels_ok: bool = True,
                   head: bool = False, single: bool = False) -> Verdict | None:
    """Which path multiplies a [n, k] weight of `dtype` at each row count (None: none here);
    single: one path for every row count (batch-invariant mode: a row's sums may not change
    with the number of rows beside it)."""
    cands = linear_candidates(n, k, dtype, kernels, panels_ok)
    if not cands:
        return None
    return _verdict(f"linear-{dtype_name(dtype)}", cands, n, k, dtype,
                    HEAD_ROWS if head else ROWS, math.inf if single else SECOND_LAYOUT_GAIN)


def argmax_verdict(n: int, k: int, dtype: torch.dtype, kernels) -> Verdict | None:
    """Whether the head's argmax kernel beats its logits and torch's argmax, per row count."""
    cands = argmax_candidates(n, k, dtype, kernels)
    return _verdict(f"argmax-{dtype_name(dtype)}", cands, n, k, dtype, HEAD_ROWS) if len(cands) > 1 else None


def prepack_linears(model: nn.Module, keep: set[int], kernels=None, head: nn.Module | None = None,
                    single: bool = False) -> int:
    """Reorders the weight of every float nn.Linear in `model` for the path the chooser picks
    for its shape (linear_verdict): in panels (`layer.panels`), for oneDNN (`layer.packed`), or
    both; `layer.route` says which runs at how many rows, and Ops.linear follows it. `head`
    (the LM head) also gets `layer.argmax_route` where its argmax kernel wins somewhere. Not
    the layers that run their own way (quantized ones carry a qformat, batch-invariant AMX ones
    a packed_weight, a mixture's router is read by moe_route). Weights whose id() is in `keep`
    stay as they are beside the packed copies. single: one path and one layout a layer, whatever
    the rows (batch-invariant mode; no argmax kernel). Returns how many were packed."""
    n = 0
    for layer in model.modules():
        if not isinstance(layer, nn.Linear) or getattr(layer, "qformat", None) is not None \
                or hasattr(layer, "packed_weight") or getattr(layer, "router", False):
            continue
        w = layer.weight
        if w is None or not can_prepack(w):
            continue
        out, k = w.shape
        panels_ok = layer.bias is None or layer.bias.dtype == torch.bfloat16   # the kernel reads a bf16 bias
        verdict = linear_verdict(out, k, w.dtype, kernels, panels_ok, head=layer is head, single=single)
        if verdict is None:
            continue
        paths = set(verdict.route.paths)
        if layer is head and layer.bias is None and not single:
            best = argmax_verdict(out, k, w.dtype, kernels)
            if best is not None and "panels" in best.route.paths:
                layer.argmax_route = best.route
                paths.add("panels")
        with torch.no_grad():
            if "panels" in paths:
                layer.panels = to_panels(w.detach())
            if "onednn" in paths:
                layer.packed = _onednn_layout(w.detach())
        layer.route = verdict.route
        if id(w) not in keep:
            layer.weight = None  # the packed copies are the only ones read from now on
        n += 1
    return n


def layer_path(layer: nn.Module) -> str | None:
    """How a packed float or W8A8 layer runs (for the log and `pagedllm env`): a path, or its
    route over row counts; None for a layer that runs its own way."""
    route = getattr(layer, "route", None) or getattr(layer, "w8_route", None)
    if route is not None:
        return route.describe()
    if getattr(layer, "wq_packed", None) is not None:
        return "onednn"
    return "plain" if getattr(layer, "qformat", None) == "w8a8" else None


def describe_paths(model: nn.Module) -> str:
    """'120 on panels, 1 on panels 1-156, onednn 157+': the model's matmuls by how they run."""
    from collections import Counter

    paths = Counter(p for m in model.modules() if isinstance(m, nn.Linear) and (p := layer_path(m)) is not None)
    return ", ".join(f"{n} on {p}" for p, n in paths.most_common())


def is_packed(layer: nn.Module) -> bool:
    return hasattr(layer, "panels") or hasattr(layer, "packed")


def packed_linear(layer: nn.Linear, x: torch.Tensor, kernels=None) -> torch.Tensor:
    """x @ W^T (+ bias) on the layer's reordered weight, on the path its route gives the rows."""
    route: Route = layer.route
    if route.pick(x.numel() // x.shape[-1]) != "panels":
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], layer.out_features)
    kernels.panel_linear(out, rows, layer.panels, layer.bias)
    return out.view(*x.shape[:-1], layer.out_features)


def argmax_ready(layer: nn.Linear, kernels) -> bool:
    """Whether packed_argmax can stand for argmax over packed_linear's output at some row counts:
    panels, no bias, and the chooser found the argmax kernel fastest there."""
    return hasattr(layer, "argmax_route") and hasattr(layer, "panels") and layer.bias is None and kernels is not None


def packed_argmax(layer: nn.Linear, x: torch.Tensor, kernels) -> torch.Tensor | None:
    """int64 [M]: the first index of each row's largest value of packed_linear(layer, x), the
    same numbers rounded the same way, without writing M x out_features of them; None at the row
    counts where the logits and torch's argmax are faster here."""
    if layer.argmax_route.pick(x.shape[0]) != "panels":
        return None
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return kernels.panel_argmax(rows, layer.panels, layer.out_features)
