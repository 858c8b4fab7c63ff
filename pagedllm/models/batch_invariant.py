"""Linear layers whose result for a row does not depend on the other rows of the call
(batch-invariant mode, --batch-invariant).

oneDNN picks its matmul kernel and blocking by the number of rows M: on this machine a
bf16 row computed with M <= 32 and with M = 33..256 differs in a few outputs in 10^5
(the order of the K reduction changes), and such a flip, carried through 30 layers,
changes a greedy token now and then. Two ways out, the first where it can run:

- bf16 with AMX: our own matmul (kernels/csrc/linear.cpp), every output one chain of
  tile dot products over K in a fixed order, whatever M. Weights are packed once into
  AMX tiles; measured as fast as oneDNN here (benchmarks/batch_invariant.py).
- anything else (fp32, fp16, CPUs without AMX, K not a multiple of 32): oneDNN on tiles of
  exactly ROW_TILE rows, the last one padded with zero rows, so each row always goes
  through the same GEMM shape. Rows of a tile do not interact (the tests check a row at
  every position of a tile). It costs: more passes over the weights, padded rows. Where
  the weights are reordered for oneDNN (prepack.py) the tiles run on them: the same
  fixed shape, 1.2-1.4x faster at 32 rows.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..util import cdiv
from .prepack import packed_linear

# 32 rows: oneDNN's small-M kernel, where 32 rows cost about as much as one.
ROW_TILE = 32
K_BLOCK = 32   # k per AMX tile (16 bf16 pairs)
PANEL = 32     # output columns per packed panel (two 16-column tiles)


def tiled(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], tile: int = ROW_TILE) -> torch.Tensor:
    """fn(x) for x [M, K], fn called on tiles of exactly `tile` rows (the last zero-padded)."""
    m = x.shape[0]
    pad = -m % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == tile:
        return fn(x)[:m]
    return torch.cat([fn(x[i:i + tile]) for i in range(0, x.shape[0], tile)])[:m]


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile: int = ROW_TILE) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], computed on tiles of exactly `tile` rows."""
    return tiled(x, lambda t: F.linear(t, weight, bias), tile)


def can_pack(weight: torch.Tensor, kernels) -> bool:
    """Whether the AMX matmul can run this weight [N, K]."""
    return (kernels is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.shape[1] % K_BLOCK == 0 and kernels.has_invariant_linear())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> AMX B tiles [ceil(N/32), K/32, 2, 16, 32]: panel p, k block kb, half h hold
    W[32p + 16h + n, 32kb + 2r + i] at [p, kb, h, r, 2n + i] (columns zero-padded)."""
    n, k = weight.shape
    padded = cdiv(n, PANEL) * PANEL
    w = F.pad(weight, (0, 0, 0, padded - n))
    return (w.view(padded // PANEL, 2, 16, k // K_BLOCK, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
            .view(padded // PANEL, k // K_BLOCK, 2, 16, 2 * 16))


def pack_linears(model: nn.Module, kernels, keep: set[int]) -> int:
    """Pack every nn.Linear of the model the AMX matmul can run (as buffer packed_weight);
    its original weight is dropped unless id(weight) is in keep (tied to an embedding).
    Returns how many were packed."""
    packed = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.weight is not None and can_pack(mod.weight, kernels):
            mod.register_buffer("packed_weight", pack_weight(mod.weight.detach()), persistent=False)
            if id(mod.weight) not in keep:
                mod.weight = None  # the packed copy replaces it: no second copy of the model in memory
            packed += 1
    return packed


def invariant_linear(layer: nn.Linear, x: torch.Tensor, kernels) -> torch.Tensor:
    """layer(x) with each row's result independent of the other rows."""
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        route = getattr(layer, "route", None)   # prepacked for this mode: one path for every row count
        assert route is None or not route.bounds, "a batch-invariant layer runs one path"
        if route is not None and route.paths[0] == "panels":  # our kernel: a row's sums never depend on the rest
            return packed_linear(layer, x, kernels)
        if route is not None:  # reordered for oneDNN: the same tiles, on the reordered weight
            return tiled(x, lambda t: packed_linear(layer, t))
        return tiled_linear(x, layer.weight, layer.bias)
    out = x.new_empty((x.shape[0], layer.out_features))
    kernels.invariant_linear(out, x.contiguous(), packed, layer.bias)
    return out
