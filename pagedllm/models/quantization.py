"""Weight-only quantization on llama.cpp's blocks of 32 weights along K, run by the CPU
kernels in kernels/csrc/quant_linear.cpp (activations and accumulation in the model's
dtype / fp32):

  q4_1: w = d * q + m, q in 0..15, d and m fp16 per block (5 bits a weight);
  q8_0: w = d * q, q in -127..127, d fp16 per block (8.5 bits a weight);
  GGUF's Q5_0, Q5_1 (5.5, 6 bits), K-quants Q4_K, Q5_K, Q6_K (4.5, 5.5, 6.56 bits) and MXFP4
  (4.25 bits: FP4 codes, a power-of-two scale per 32; gpt-oss's experts, from a GGUF file or
  from HF's layout, families/gpt_oss.py): the file's own bytes (RawBlocks), unpacked block by block
  inside the same GEMM loop.

`quantization="gguf"` runs a GGUF file's own blocks (loader/gguf_quant.py), "int4" makes
q4_1 blocks from float weights (llama.cpp's rounding), "int8" q8_0 blocks. A decode step
at one request reads every weight once and does little else, so its time follows the
weights' bytes: q4_1 + a q8_0 LM head read 97 MB a token against bf16's 270 MB, and one
request decodes ~2x faster than bf16. Batches (decode of many sequences, prefill) run the
same kernels: a group of 4 output rows is dequantized into an L1 scratch inside the GEMM's
loop and every tile of activation rows runs over it with bf16 dot products, so a batch pays
bf16's arithmetic, reads a third of its bytes, and no layer is ever dequantized whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.chooser import Candidate, Verdict, chooser, dtype_name
from .w8a8 import W8A8
from .w8a8 import embed_rows as w8a8_rows

G = 32  # weights per block
Q4_1, Q8_0 = "q4_1", "q8_0"


@dataclass
class Blocks:
    """One weight [N, K] as blocks: q [N, K/32, 32] (uint8 0..15 for q4_1, int8 for q8_0),
    d and m (q4_1 only) [N, K/32], fp16 values (as GGUF stores them) in any float dtype."""
    fmt: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * G

    def rows(self, index: torch.Tensor) -> Blocks:
        """Output rows `index` (whole rows move: blocks stay intact)."""
        return Blocks(self.fmt, self.q[index], self.d[index], None if self.m is None else self.m[index])

    def dequantize(self) -> torch.Tensor:
        w = self.q.float() * self.d.float()[..., None]
        if self.m is not None:
            w = w + self.m.float()[..., None]
        return w.reshape(self.shape)


# GGUF block types kept as the file's bytes: ggml's type id, bytes per block, weights per block.
RAW_TYPES = {"Q5_0": (6, 22, 32), "Q5_1": (7, 24, 32), "Q4_K": (12, 144, 256), "Q5_K": (13, 176, 256),
             "Q6_K": (14, 210, 256), "MXFP4": (39, 17, 32)}


@dataclass
class RawBlocks:
    """One weight [N, K] as a GGUF file stores it in one of RAW_TYPES: raw uint8 [N, row bytes]."""
    fmt: str
    raw: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        _, nbytes, weights = RAW_TYPES[self.fmt]
        return self.raw.shape[0], self.raw.shape[1] // nbytes * weights

    def rows(self, index: torch.Tensor) -> RawBlocks:
        return RawBlocks(self.fmt, self.raw[index])

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        return torch.from_numpy(quants.dequantize(self.raw.numpy(), GGMLQuantizationType[self.fmt]))

    def as_q8_0(self) -> Blocks:
        """Q5_0 as q8_0, exactly (w = d (q - 16), q - 16 in -16..15): to fuse with a q8_0 part."""
        if self.fmt != "Q5_0":
            raise ValueError(f"{self.fmt} blocks have no exact q8_0 form")
        b = self.raw.reshape(self.raw.shape[0], -1, 22)
        d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
        qh = b[..., 2:6].contiguous().view(torch.int32)[..., 0]
        high = (qh[..., None] >> torch.arange(32, dtype=torch.int32)) & 1
        nib = b[..., 6:22].to(torch.int32)
        q = torch.cat([nib & 15, nib >> 4], dim=-1) | (high << 4)
        return Blocks(Q8_0, (q - 16).to(torch.int8), d)


# A GGUF file's matmul weights as the loader reads them (loader/gguf_quant.py): blocks by HF
# parameter name, and a note for each weight left out ("blk.0.ffn_down.weight: IQ4_XS").
GGUFBlocks = tuple[dict[str, "Blocks | RawBlocks"], list[str]]


def cat_rows(parts: list[Blocks | RawBlocks]) -> Blocks | RawBlocks:
    """The blocks of torch.cat([w...]) (fused q/k/v, gate/up). Parts of one format keep it;
    Q5_0 beside q8_0 parts becomes q8_0 (exactly); other mixes cannot fuse (ValueError)."""
    fmts = {p.fmt for p in parts}
    if fmts == {Q8_0, "Q5_0"}:
        parts = [p.as_q8_0() if isinstance(p, RawBlocks) else p for p in parts]
        fmts = {Q8_0}
    if len(fmts) > 1:
        raise ValueError(f"cannot fuse blocks of formats {[p.fmt for p in parts]}")
    fmt = parts[0].fmt
    if isinstance(parts[0], RawBlocks):
        return RawBlocks(fmt, torch.cat([p.raw for p in parts]))
    m = None if fmt == Q8_0 else torch.cat([p.m for p in parts])
    return Blocks(fmt, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)


def quantize_q4_1(w: torch.Tensor) -> Blocks:
    """llama.cpp's quantize_row_q4_1: per block d = (max - min) / 15, m = min, q = round((w - m) / d);
    d and m rounded to fp16 first, so q rounds against the scales that are kept."""
    n, k = w.shape
    if k % G:
        raise ValueError(f"int4 needs K a multiple of {G}, got a weight of shape {tuple(w.shape)}")
    b = w.detach().float().reshape(n, k // G, G)
    mn, mx = b.amin(-1).half().float(), b.amax(-1)
    d = ((mx - mn) / 15).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.round((b - mn[..., None]) * inv[..., None]), 0, 15).to(torch.uint8)
    return Blocks(Q4_1, q, d, mn)


def quantize_q8_0(w: torch.Tensor) -> Blocks:
    """llama.cpp's quantize_row_q8_0: per block d = max|w| / 127, q = round(w / d)."""
    n, k = w.shape
    if k % G:
        raise ValueError(f"int8 needs K a multiple of {G}, got a weight of shape {tuple(w.shape)}")
    b = w.detach().float().reshape(n, k // G, G)
    d = (b.abs().amax(-1) / 127).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.round(b * inv[..., None]), -127, 127).to(torch.int8)
    return Blocks(Q8_0, q, d)


# The GGUF types a linear layer (or a mixture's experts) runs as blocks: Q4_0 as q4_1, the rest as they are.
GGUF_RUNNABLE = ("Q4_0", "Q4_1", "Q8_0", *RAW_TYPES)
# The kernels' id of each format (kernels/csrc/blocks.h: ggml's type ids; q4_1 ours, in pairs).
FORMAT_IDS = {Q4_1: 3, Q8_0: 8, **{fmt: ids[0] for fmt, ids in RAW_TYPES.items()}}


def pack(blocks: Blocks | RawBlocks) -> list[torch.Tensor]:
    """The kernels' layout of `blocks` (quant_linear.cpp), made once: raw bytes as they are;
    q8_0 codes and fp16 scales; q4_1 in pairs of blocks, one byte holding element i of both,
    with fp16 scales and mins (an odd last block pairs with an empty one)."""
    if isinstance(blocks, RawBlocks):
        return [blocks.raw.contiguous()]
    d = blocks.d.half()  # scales are fp16 values (GGUF's, or rounded so by quantize_*)
    if blocks.fmt == Q8_0:
        return [blocks.q.contiguous(), d.contiguous()]
    if blocks.fmt != Q4_1:
        raise ValueError(f"unknown block format {blocks.fmt!r}")
    q, m = blocks.q, blocks.m.half()
    if q.shape[1] % 2:
        q = F.pad(q, (0, 0, 0, 1))
        d, m = F.pad(d, (0, 1)), F.pad(m, (0, 1))
    return [(q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), d.contiguous(), m.contiguous()]


def unpack(fmt: str, parts: list[torch.Tensor], k: int) -> Blocks | RawBlocks:
    """The blocks of pack()'s tensors `parts` (rows along their first dim; K along a row)."""
    if fmt in RAW_TYPES:
        return RawBlocks(fmt, parts[0])
    if fmt == Q8_0:
        return Blocks(Q8_0, parts[0], parts[1])
    nblk, qs = k // G, parts[0]
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(qs.shape[0], -1, G)
    return Blocks(Q4_1, q[:, :nblk], parts[1][:, :nblk], parts[2][:, :nblk])


def set_blocks(layer: nn.Linear, blocks: Blocks | RawBlocks, dtype: torch.dtype) -> None:
    """Give `layer` the kernels' layout of `blocks` (pack) and drop its float weight."""
    n, k = blocks.shape
    if (n, k) != (layer.out_features, layer.in_features):
        raise ValueError(f"blocks of shape {(n, k)} for a layer of shape {(layer.out_features, layer.in_features)}")
    parts = pack(blocks)
    names = ("qraw",) if isinstance(blocks, RawBlocks) else ("qs", "qd", "qm")
    for name, t in zip(names, parts):
        layer.register_buffer(name, t, persistent=False)
    layer.qformat, layer.qdtype = blocks.fmt, dtype
    layer.weight = None


def layer_blocks(layer: nn.Linear, rows: torch.Tensor | None = None) -> Blocks:
    """The blocks a layer runs (output rows `rows`, default all), unpacked again (tests,
    embedding lookups: only the looked-up rows)."""
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    return unpack(layer.qformat, [pick(getattr(layer, n)) for n in _block_parts(layer.qformat)], layer.in_features)


def dequantize(layer: nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight [N, K] in dtype (where the kernels cannot run)."""
    return layer_blocks(layer).dequantize().to(dtype)


def block_linear(layer: nn.Linear, x: torch.Tensor, kernels=None) -> torch.Tensor:
    """layer(x) from its blocks: the block kernel, except at the row counts where the chooser
    found the weight dequantized and torch's matmul faster here (`layer.block_route`: a
    prefill's rows on AMX, say); the latter too where the kernels are missing (or for fp16).
    A decode step calls this ~120 times for a ~50 us kernel each (SmolLM2 on q4_1 blocks): the
    buffers are read from the module's dicts, not through nn.Module.__getattr__ (and no exception
    for a missing route), which took this wrapper from ~20 to ~9 us a call."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    route = layer.__dict__.get("block_route")
    if kernels is not None and x2.dtype in (torch.bfloat16, torch.float32) \
            and (route is None or route.pick(x2.shape[0]) == "blocks"):
        out = x2.new_empty((x2.shape[0], layer.out_features))
        buf = layer._buffers if isinstance(layer, nn.Module) else vars(layer)  # (the chooser's copies: namespaces)
        x2, fmt = x2.contiguous(), layer.qformat
        if fmt == Q4_1:
            kernels.q4_1_linear(out, x2, buf["qs"], buf["qd"], buf["qm"])
        elif fmt in RAW_TYPES:
            kernels.ggml_linear(out, x2, buf["qraw"], RAW_TYPES[fmt][0])
        else:
            kernels.q8_0_linear(out, x2, buf["qs"], buf["qd"])
    else:
        out = F.linear(x2, dequantize(layer, x2.dtype))
    if layer.bias is not None:
        out = out + layer.bias
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], layer.out_features)


def _block_parts(fmt: str) -> tuple[str, ...]:
    return ("qraw",) if fmt in RAW_TYPES else ("qs", "qd") if fmt == Q8_0 else ("qs", "qd", "qm")


DEQUANT_MAX_BYTES = 256 << 20


def blocks_verdict(layer: nn.Linear, kernels) -> Verdict:
    """Which path multiplies a quantized layer's blocks at each row count here: the block kernel,
    or the weight dequantized on each call and torch's matmul (oneDNN's: AMX where the CPU has
    it). Timed on copies of the layer's own blocks (their format and shape are what matters)."""
    parts = _block_parts(layer.qformat)
    n, k, dtype = layer.out_features, layer.in_features, layer.qdtype

    def weight(_g: torch.Generator) -> SimpleNamespace:
        return SimpleNamespace(qformat=layer.qformat, in_features=k, out_features=n, bias=None,
                               **{p: getattr(layer, p).clone() for p in parts})

    cands = [Candidate("blocks", lambda w: w, lambda w, x: block_linear(w, x, kernels))]
    # (A GGUF file's own types dequantize through numpy: never a match. A weight past
    # DEQUANT_MAX_BYTES dequantized, Gemma 3's 262144 x 640 LM head say, would be a transient
    # copy of that size on every call, and timing it took a minute of a 2-core CPU.)
    if layer.qformat in (Q8_0, Q4_1) and n * k * dtype.itemsize <= DEQUANT_MAX_BYTES:
        cands.append(Candidate("dequant", lambda w: w, lambda w, x: F.linear(x, dequantize(w, x.dtype))))
    nbytes = sum(getattr(layer, p).numel() * getattr(layer, p).element_size() for p in parts)
    return chooser().choose(f"blocks-{layer.qformat}-{dtype_name(dtype)}", (n, k), 2 * n * k, cands,
                            weight, nbytes, lambda m: torch.randn(m, k).to(dtype), sources=("quant_linear.cpp",))


def choose_block_paths(model: nn.Module, kernels) -> int:
    """Gives each CPU layer on quantized blocks its route (blocks_verdict) where dequantizing wins
    some row counts; the routes share the one copy of the blocks. How many got one."""
    if kernels is None:
        return 0
    n = 0
    for layer in model.modules():
        fmt = getattr(layer, "qformat", None)
        if not isinstance(layer, nn.Linear) or fmt is None or fmt == W8A8 or layer.qdtype not in (torch.bfloat16, torch.float32):
            continue
        route = blocks_verdict(layer, kernels).route
        if "dequant" in route.paths:
            layer.block_route = route
            n += 1
    return n


def embed_rows(layer: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a quantized weight (a tied embedding's lookup), in the layer's dtype:
    only the looked-up rows are unpacked."""
    if layer.qformat == W8A8:
        return w8a8_rows(layer, ids)
    rows = layer_blocks(layer, ids.reshape(-1))
    return rows.dequantize().to(layer.qdtype).reshape(*ids.shape, layer.in_features)


def is_router(name: str) -> bool:
    """A mixture of experts' router (and Qwen2-MoE's shared expert's gate): kept float, as
    llama.cpp keeps ffn_gate_inp, since its scores pick the experts."""
    return name.endswith(("mlp.gate", "shared_expert_gate"))


def quantize_linears(model: nn.Module, method: str, dtype: torch.dtype) -> int:
    """Replace every nn.Linear's float weight by blocks made from it: "int8" q8_0 blocks,
    "int4" q4_1 blocks except the LM head (q8_0: its errors go straight into the logits,
    as llama.cpp's own Q4 files keep their output layer at 6-8 bits). Returns how many
    layers were quantized."""
    n = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or mod.weight is None or is_router(name):
            continue
        four = method == "int4" and not name.endswith("lm_head")
        blocks = quantize_q4_1(mod.weight) if four else quantize_q8_0(mod.weight)
        set_blocks(mod, blocks, dtype)
        n += 1
    return n
