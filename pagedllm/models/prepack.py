"""Float matmul weights reordered once into oneDNN's blocked layout for this CPU.

`F.linear` hands oneDNN a plain [out, in] weight on every call, and oneDNN reorders it into
the blocked layout its kernels read before it multiplies: at decode batch sizes that reorder
costs as much as the matmul. Reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`,
what torch's own compiler does for frozen CPU graphs) the same products run 1.26-3.2x faster
at one row, 1.14-1.3x at 32 and 1.01-1.16x at 96-256 in bf16, more in fp32
(benchmarks/linear_prepack.py on SmolLM2's and TinyLlama's shapes; BENCHMARKS.md §30). The results are the same numbers: the
reordered weight holds the same values, only where they lie in memory differs.

The plain weight is then dropped (a layer keeps one copy), except where it is shared with
the input embedding (tied LM heads), which still looks rows up in it.
"""
from __future__ import annotations

import os

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float32)


def prepack_wanted() -> bool:
    """PAGEDLLM_PREPACK=0 keeps plain weights (for comparisons: benchmarks/linear_prepack.py)."""
    return os.environ.get("PAGEDLLM_PREPACK", "1").strip() != "0"


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def prepack_linears(model: nn.Module, keep: set[int]) -> int:
    """Reorders the weight of every float nn.Linear in `model` and stores it as `layer.packed`,
    which Ops.linear then uses; not the layers that run their own way (quantized ones carry a
    qformat, batch-invariant AMX ones a packed_weight, a mixture's router is read by moe_route). Weights whose id() is in `keep` stay as
    they are beside the packed copy. Returns how many were packed."""
    n = 0
    for layer in model.modules():
        if not isinstance(layer, nn.Linear) or getattr(layer, "qformat", None) is not None \
                or hasattr(layer, "packed_weight") or getattr(layer, "router", False):
            continue
        w = layer.weight
        if w is None or not can_prepack(w):
            continue
        with torch.no_grad():
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        if id(w) not in keep:
            layer.weight = None  # the packed copy is the only one read from now on
        n += 1
    return n


def packed_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
