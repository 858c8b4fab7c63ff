"""W8A8 (`quantization="w8a8"`): int8 weights with a scale per output channel, int8
activations with a scale per token computed at run time, int32 accumulation.

    y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k]

Weights are quantized at load (symmetric, sw = max|w[n, :]| / 127). Each row of the
activations is quantized on its own (sx = max|x[m, :]| / 127), so a row's result does not
depend on the rows beside it; the integer sum is exact, whatever order oneDNN adds it in,
so the whole matmul is batch-invariant bit for bit. On a CPU with AVX512-VNNI an int8 dot
product runs at twice the bf16 rate (AMX-INT8 several times more), and the weights are
half of bf16's bytes, which is what one request's decode streams.

The matmul is oneDNN's int8 GEMM where the CPU has int8 dot products (VNNI, AMX) or on a GPU.
Without them oneDNN's int8 path runs 5-28x slower than float32 sgemm (measured on a Zen 3 EPYC,
AVX2: 112 ms against 20 ms for 8 rows of the 576 x 49152 head), so there the same integer sums
go through sgemm in float32, exactly (int_matmul).

On a CPU, a weight is reordered once at load into oneDNN's blocked layout (`pack_w8a8`,
onednn::qlinear_pointwise), as the float weights are (prepack.py), where the chooser
(kernels/chooser.py) finds that faster here than torch._int_mm on the plain weight, which
reorders it on every call: per shape and row range, timed at first load and cached. On the
2-core Zen 4 over TinyLlama-1.1B's shapes (benchmarks/linear_prepack.py --dtype int8) the
reordered weights ran 1.7-3.3x at 8 rows, 1.35-1.9x at 32, 1.05-1.37x at 96-256, and 0.7-1.6x
at one row; on SmolLM2's 576-wide layers, where onednn::qlinear_pointwise's ~20 us a call
outweighs a reorder of a few hundred KiB, 0.5x at one row. An AMX-INT8 CPU moves all of these. VNNI
multiplies unsigned activations by signed weights, so the reordered path takes each code plus
128 as uint8 with a zero point of 128: oneDNN subtracts 128 * sum(w) in int32, and the sums
are the same integers.

The kernels (kernels/csrc/w8a8.cpp) quantize the rows in one pass and scale the sums into the
output dtype with the bias in another. Without the kernels the same steps run as torch
expressions.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from ..kernels.chooser import ROWS as CHOICE_ROWS, Candidate, dtype_name, Route, Verdict, chooser
from ..util import cpu_flags

W8A8 = "w8a8"


def _symmetric_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and fp32 scales: s = max|row| / 127, q = round(row / s) (0 rows: s = 0, q = 0)."""
    xf = x.detach().float()
    s = xf.abs().amax(dim=1) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return torch.clamp(torch.round(xf * inv[:, None]), -127, 127).to(torch.int8), s


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and fp32 scales [N]: symmetric per output channel, round to nearest."""
    return _symmetric_rows(w)


def set_w8a8(layer: nn.Linear, dtype: torch.dtype) -> None:
    """Quantize `layer`'s float weight in place of it. The int8 weight stays [N, K] and
    _int_mm gets its transpose: oneDNN runs that layout as fast as [K, N] for a batch and
    several times faster for one row (measured: 6x at M = 1 on 2048 x 5632)."""
    q, s = quantize_weight(layer.weight)
    layer.register_buffer("wq", q.contiguous(), persistent=False)
    layer.register_buffer("ws", s.contiguous(), persistent=False)
    layer.qformat, layer.qdtype = W8A8, dtype
    layer.weight = None


ZERO_POINT = 128  # of the uint8 activations the reordered weights' kernels take


def quantize_rows(x: torch.Tensor, kernels=None, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and fp32 scales [M]: symmetric per row (per token). offset: the same codes
    plus 128, as uint8 (what the reordered weights' kernels take)."""
    if kernels is not None and x.dtype in (torch.bfloat16, torch.float32) and x.shape[1] % 16 == 0:
        q = torch.empty(x.shape, dtype=torch.uint8 if offset else torch.int8)
        s = torch.empty(x.shape[0], dtype=torch.float32)
        (kernels.quantize_rows_u8 if offset else kernels.quantize_rows_int8)(q, s, x)
        return q, s
    q, s = _symmetric_rows(x)
    return ((q.to(torch.int16) + ZERO_POINT).to(torch.uint8) if offset else q), s


def can_pack_w8a8() -> bool:
    """oneDNN's int8 kernels on reordered weights: where the CPU has int8 dot products."""
    return torch.backends.mkldnn.is_available() and cpu_has_int8_dot() and \
        hasattr(torch.ops.onednn, "qlinear_prepack")


@lru_cache(maxsize=64)
def _unit_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The reordered matmul applies no scale (ones) and no weight zero point: it returns the float
    # of each int32 sum, and scale_float applies the per-token and per-channel scales as scale_int32 does.
    return torch.ones(n), torch.zeros(n, dtype=torch.long)


def pack_w8a8(layer: nn.Linear, keep_plain: bool = False) -> None:
    """Reorder a W8A8 layer's int8 weight once for oneDNN (`layer.wq_packed`); the plain
    copy goes unless keep_plain (a tied LM head: the embedding looks its rows up in it)."""
    layer.wq_packed = torch.ops.onednn.qlinear_prepack(layer.wq, None)
    if not keep_plain:
        layer.wq = None


@dataclass
class Int8Weight:
    """What w8a8_linear reads of a layer, for timing its paths on a weight of no layer."""
    wq: torch.Tensor | None
    ws: torch.Tensor
    out_features: int
    wq_packed: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    w8_route: Route | None = None


def w8a8_candidates(kernels) -> list[Candidate]:
    """W8A8's paths here: oneDNN's int8 on the reordered weight (where the CPU has int8 dot
    products), torch._int_mm (or exact sgemm) on the plain one. Both give the same int32 sums."""
    plain = Candidate("plain", lambda w: w, lambda w, x: w8a8_linear(w, x, kernels))
    if not can_pack_w8a8():
        return [plain]
    reordered = Candidate("onednn", lambda w: Int8Weight(None, w.ws, w.out_features,
                                                         torch.ops.onednn.qlinear_prepack(w.wq, None)),
                          lambda w, x: w8a8_linear(w, x, kernels))
    return [reordered, plain]


def w8a8_verdict(n: int, k: int, dtype: torch.dtype, kernels) -> Verdict:
    """Which W8A8 path multiplies a [n, k] int8 weight, with activations of `dtype`, per row count."""
    def weight(g: torch.Generator) -> Int8Weight:
        return Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g) / 100, n)

    return chooser().choose(f"w8a8-{dtype_name(dtype)}", (n, k), 2 * n * k, w8a8_candidates(kernels),
                            weight, n * k, lambda m: torch.randn(m, k).to(dtype), CHOICE_ROWS, sources=("w8a8.cpp",))


def pack_w8a8_linears(model: nn.Module, keep: set[int], kernels=None) -> int:
    """Reorders the int8 weight of each CPU W8A8 layer where the chooser finds oneDNN's reordered
    path fastest for its shape (w8a8_verdict), keeping the plain one too where that wins some row
    counts (`layer.w8_route` then says which runs) or the layer's id() is in `keep`; how many."""
    n = 0
    for mod in model.modules():
        if getattr(mod, "qformat", None) != W8A8 or mod.wq is None or mod.wq.device.type != "cpu" \
                or hasattr(mod, "wq_packed"):
            continue
        route = w8a8_verdict(mod.out_features, mod.in_features, mod.qdtype, kernels).route
        if "onednn" not in route.paths:
            continue
        pack_w8a8(mod, keep_plain=id(mod) in keep or "plain" in route.paths)
        mod.w8_route = route if len(route.paths) > 1 else None
        n += 1
    return n


@lru_cache(maxsize=1)
def cpu_has_int8_dot() -> bool:
    """VNNI or AMX-INT8: what oneDNN's int8 GEMM needs to beat float32 on a CPU."""
    flags = cpu_flags()
    return flags is None or bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})  # not Linux: oneDNN


# |int8 x int8| <= 2^14, so any float32 sum of at most 1024 such products is an integer of at most
# 2^24 at every step, which float32 holds exactly: sgemm over K in slices of 1024 is exact in any
# order of addition (so batch-invariant too), and the slices add up in int32.
EXACT_K = 1024
ROWS = 1024   # weight rows converted to float32 at a time: 2.3 MiB at K = 576, which stays in cache


def int_matmul_f32(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = xq [M, K] @ wq [N, K]^T, exact, through float32 sgemm."""
    xf = xq.float()
    out = torch.empty(xq.shape[0], wq.shape[0], dtype=torch.int32, device=xq.device)
    for n in range(0, wq.shape[0], ROWS):
        wf = wq[n:n + ROWS].float()
        acc = out[:, n:n + ROWS]
        for k in range(0, xq.shape[1], EXACT_K):
            part = torch.mm(xf[:, k:k + EXACT_K], wf[:, k:k + EXACT_K].t()).to(torch.int32)
            acc.copy_(part) if k == 0 else acc.add_(part)
    return out


def int_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = xq [M, K] @ wq [N, K]^T, exact (either path: the same integers). One row
    stays on oneDNN even without int8 dot products: its matrix-vector path is 2.5x the slices'
    speed over a layer's matmuls there, which pay a float32 copy of the weight for one row
    (benchmarks/int8_matmul.py)."""
    if xq.device.type == "cpu" and xq.shape[0] > 1 and not cpu_has_int8_dot():
        return int_matmul_f32(xq, wq)
    return torch._int_mm(xq, wq.t())


def packed_int_matmul(xu: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """float32 [M, N]: the float of each int32 sum of (xu - 128) [M, K] @ wq [N, K]^T, on the
    reordered weight."""
    ones, zeros = _unit_scales(layer.out_features)
    return torch.ops.onednn.qlinear_pointwise(xu, 1.0, ZERO_POINT, layer.wq_packed, ones, zeros, None, 1.0, 0,
                                              torch.float32, "none", [], "")


def w8a8_linear(layer: nn.Linear, x: torch.Tensor, kernels=None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    route = getattr(layer, "w8_route", None)   # only ever set on a CPU layer, as wq_packed
    packed = getattr(layer, "wq_packed", None) is not None if route is None else route.pick(x2.shape[0]) == "onednn"
    xq, sx = quantize_rows(x2, kernels, offset=packed)
    acc = packed_int_matmul(xq, layer) if packed else int_matmul(xq, layer.wq)
    if kernels is not None and x2.dtype in (torch.bfloat16, torch.float32) and acc.shape[1] % 16 == 0:
        out = x2.new_empty(acc.shape)
        (kernels.scale_float if packed else kernels.scale_int32)(out, acc, sx, layer.ws, layer.bias)
    else:
        out = (acc.float() * sx[:, None] * layer.ws[None, :]).to(x2.dtype)
        if layer.bias is not None:
            out = out + layer.bias
    return out.reshape(*x.shape[:-1], layer.out_features)


def embed_rows(layer: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a W8A8 weight (a tied embedding's lookup), in the layer's dtype."""
    flat = ids.reshape(-1)
    rows = layer.wq[flat].float() * layer.ws[flat, None]
    return rows.to(layer.qdtype).reshape(*ids.shape, layer.in_features)


def quantize_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Every nn.Linear with a float weight (the LM head included) to W8A8. Returns how many."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.weight is not None and not getattr(mod, "router", False):
            set_w8a8(mod, dtype)   # (a mixture's router stays float: its scores pick the experts)
            n += 1
    return n
