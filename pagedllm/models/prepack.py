"""Float matmul weights reordered once at load, for the kernel that multiplies them.

bf16 weights, where the CPU kernels were built with AVX512-BF16, go in panels of 32 output
columns for our own kernel (kernels/csrc/bf16_panels.h): on SmolLM2-135M's step, weights read
from memory, it runs 1.67x oneDNN's reordered matmul at one row, 1.5x at 20 rows and 1.1x at 96
(BENCHMARKS.md §42), and a row's result does not depend on the rows beside it. Other float
weights (fp32, or a CPU without AVX512-BF16) go in oneDNN's blocked layout:

`F.linear` hands oneDNN a plain [out, in] weight on every call, and oneDNN reorders it into
the blocked layout its kernels read before it multiplies: at decode batch sizes that reorder
costs as much as the matmul. Reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`,
what torch's own compiler does for frozen CPU graphs) the same products run 1.26-3.2x faster
at one row, 1.14-1.3x at 32 and 1.01-1.16x at 96-256 in bf16, more in fp32
(benchmarks/linear_prepack.py on SmolLM2's and TinyLlama's shapes; BENCHMARKS.md §30). The results are the same numbers: the
reordered weight holds the same values, only where they lie in memory differs.

The plain weight is then dropped (a layer keeps one copy), except where it is shared with
the input embedding (tied LM heads), which still looks rows up in it. PAGEDLLM_PREPACK=0 keeps
plain weights, =onednn oneDNN's layout for bf16 too (for comparisons: benchmarks/prepack_ab.py).
"""
from __future__ import annotations

import os

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float32)
PANEL = 32  # output columns of a panel (bf16_panels.h)


def prepack_wanted() -> bool:
    """PAGEDLLM_PREPACK=0 keeps plain weights (for comparisons: benchmarks/linear_prepack.py)."""
    return os.environ.get("PAGEDLLM_PREPACK", "1").strip() != "0"


def panels_wanted(kernels) -> bool:
    """bf16 weights go in panels for our kernel: it is built (AVX512-BF16) and not turned off
    (PAGEDLLM_PREPACK=onednn)."""
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


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def prepack_linears(model: nn.Module, keep: set[int], kernels=None) -> int:
    """Reorders the weight of every float nn.Linear in `model`: into panels (`layer.panels`) where
    panels_wanted(kernels) and the weight is bf16 with K even, else for oneDNN (`layer.packed`);
    Ops.linear then uses it. Not the layers that run their own way (quantized ones carry a
    qformat, batch-invariant AMX ones a packed_weight, a mixture's router is read by moe_route).
    Weights whose id() is in `keep` stay as they are beside the packed copy. Returns how many
    were packed."""
    n = 0
    panels = panels_wanted(kernels)
    for layer in model.modules():
        if not isinstance(layer, nn.Linear) or getattr(layer, "qformat", None) is not None \
                or hasattr(layer, "packed_weight") or getattr(layer, "router", False):
            continue
        w = layer.weight
        if w is None or not can_prepack(w):
            continue
        with torch.no_grad():
            if panels and w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0 \
                    and (layer.bias is None or layer.bias.dtype == torch.bfloat16):   # the kernel reads a bf16 bias
                layer.panels = to_panels(w.detach())
            else:
                layer.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        if id(w) not in keep:
            layer.weight = None  # the packed copy is the only one read from now on
        n += 1
    return n


def is_packed(layer: nn.Module) -> bool:
    return hasattr(layer, "panels") or hasattr(layer, "packed")


def packed_linear(layer: nn.Linear, x: torch.Tensor, kernels=None) -> torch.Tensor:
    """x @ W^T (+ bias) on the layer's reordered weight."""
    if not hasattr(layer, "panels"):
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], layer.out_features)
    kernels.panel_linear(out, rows, layer.panels, layer.bias)
    return out.view(*x.shape[:-1], layer.out_features)


def argmax_ready(layer: nn.Linear, kernels) -> bool:
    """Whether packed_argmax can stand for argmax over packed_linear's output: panels, no bias."""
    return hasattr(layer, "panels") and layer.bias is None and kernels is not None


def packed_argmax(layer: nn.Linear, x: torch.Tensor, kernels) -> torch.Tensor:
    """int64 [M]: the first index of each row's largest value of packed_linear(layer, x), the
    same numbers rounded the same way, without writing M x out_features of them."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return kernels.panel_argmax(rows, layer.panels, layer.out_features)
