"""Triton kernels for paged attention: K/V stay in their blocks and are read in place
through the block tables (no gather copy).

  reshape_and_cache  write the step's new K/V rows into their slots
  paged_decode       one query token per sequence; the context is split into partitions
                     run in parallel (split-K), then reduced: long contexts fill the GPU
  paged_prefill      query chunks of variable length over a cached prefix plus themselves,
                     causal by absolute position

Both take a sliding window W (0: full attention): a query at p sees keys p - W < j <= p, and
tiles wholly below the window are skipped, so a table's entries there (-1: blocks the KV
manager released) are never read.

Cache layout: [num_blocks, block_size, kv_heads, head_dim], contiguous; token j of a
sequence lives at slot table[j // B] * B + j % B. GQA: query head h reads kv head h // (H / KVH).

fp8 pools (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) are uint8 [num_blocks, block_size, kv_heads,
head_dim + 2]: each token-head row is kv_quant's, its D fp8 codes of x H (x rotated by the
Hadamard matrix), then its bf16 scale. The kernels take queries already rotated (q H) and
give outputs still rotated (the caller multiplies by H again: H H = I). A tile's codes are
widened to fp16 exactly by moving bits (_fp8_as_fp16: sm_80 has no e4m3 type at all), the
dots run on them, and the token's scale multiplies its score and its softmax weight, not
each of its D values. The unquantized variants (FP8=0) compile as before.

On a machine without CUDA these run under Triton's interpreter (TRITON_INTERPRET=1, set
here before the kernels are defined), which is how the tests check them on CPU.
"""
from __future__ import annotations

import os

import torch

from ..kv_dtype import SCALE_BYTES, KVDtype
from . import kv_quant

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if not torch.cuda.is_available():
    from triton.runtime.interpreter import InterpretedFunction

    # Triton's own library functions (tl.zeros, tl.sum, ...) are interpreted only if the
    # variable was set before triton was first imported; otherwise the kernels fail deep
    # inside the interpreter with "Cannot call @triton.jit'd outside of the scope of a kernel".
    if triton.knobs.runtime.interpret and not isinstance(tl.zeros, InterpretedFunction):
        raise ImportError("the Triton backend on a machine without CUDA runs under Triton's interpreter, but triton "
                          "was imported (by transformers or another library) before TRITON_INTERPRET=1 could be "
                          "set: export TRITON_INTERPRET=1 before starting, or use --attention-backend torch")

# Decode: tokens per partition (one program) and per inner tile. Very long bounds (a CUDA
# graph captured at a 128k max_model_len) get longer partitions, at most MAX_PARTS of them,
# so the partial-result buffers stay small.
PARTITION = 512
MAX_PARTS = 32
DECODE_TILE = 64
PREFILL_M = 32
PREFILL_N = 64
# What the kernels take for "no window": wider than any context, and ctx - it still fits int32.
NO_WINDOW = 1 << 30


def _window_arg(window: int) -> int:
    return window if window > 0 else NO_WINDOW


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


# The kernels' FP8 constexpr: 0 plain K/V; the fp8 kind of a quantized pool.
FP8_KINDS = {"fp8_e4m3": 1, "fp8_e5m2": 2}
_SCALE_BYTES = tl.constexpr(SCALE_BYTES)  # after a row's codes
# fp8 rows are D + 2 bytes, so a row starts only 2-byte aligned: codes come in 2-byte loads
# through registers (no cp.async). At 4 warps a 64-key tile of K and V at head dim 128 took
# 236-255 registers (prefill spilled on sm_80); at 8 warps prefill takes 188-208, and decode
# with 32-key tiles at most 128 (at 64, ptxas spilled the int32-indexed CUDA-graph variant).
FP8_WARPS = 8


def _fp8_arg(kv: KVDtype | None) -> int:
    if kv is None:
        return 0
    if kv.name not in FP8_KINDS:
        raise ValueError(f"the Triton kernels read fp8 KV ({', '.join(FP8_KINDS)}), not {kv.name}")
    return FP8_KINDS[kv.name]


@triton.jit
def _reshape_and_cache(k_ptr, v_ptr, k_cache, v_cache, slots, stride_k, stride_v,
                       KVD: tl.constexpr, BKVD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    offs = tl.arange(0, BKVD)
    m = (offs < KVD) & ((offs * 0 + slot) >= 0)  # slot -1: a padding row (CUDA graph buckets)
    k = tl.load(k_ptr + t * stride_k + offs, mask=m)
    v = tl.load(v_ptr + t * stride_v + offs, mask=m)
    tl.store(k_cache + slot * KVD + offs, k, mask=m)
    tl.store(v_cache + slot * KVD + offs, v, mask=m)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv: KVDtype | None = None) -> None:
    """k, v [T, KVH, D] (rows may be strided, each row contiguous) -> their slots.
    kv: the pools' fp8 kind: each row is quantized first (kv_quant's torch quantizer, the
    reference itself), and its bytes stored by the same kernel (slot -1 rows: nothing)."""
    t, kvh, d = k.shape
    if t == 0:
        return
    if kv is not None:
        _fp8_arg(kv)
        k, v = kv_quant.quantize(k, kv, key=True), kv_quant.quantize(v, kv)  # [T, KVH, D + 2] uint8
        d = k.shape[2]
    assert k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d
    _reshape_and_cache[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                             KVD=kvh * d, BKVD=triton.next_power_of_2(kvh * d))


# The interpreter's dot is numpy's, which has no bf16: it would multiply raw bits. There,
# half-precision tiles are widened first (same products: bf16 x bf16 is exact in fp32).
_WIDEN_DOT = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs: exact products (tl.dot would round them to TF32 on a GPU).
    if _WIDEN_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _fp8_as_fp16(c, FP8: tl.constexpr):
    """uint8 fp8 codes -> fp16, exactly, by moving bits (any GPU; e4m3's type needs sm_89).
    e5m2 is the top byte of an fp16. e4m3's sign goes to bit 15 and its 4 exponent and 3
    mantissa bits under fp16's 5-bit exponent: the fp16 is its value / 2^8 (exponent
    bias 15, not 7), subnormals included; _fp8_unit multiplies it back through the scale.
    (The quantizer clamps to the finite range: the NaN code 0x7f never occurs.)"""
    c = c.to(tl.uint16)  # the width of the fp16 bits it becomes
    if FP8 == 1:
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    else:
        bits = c << 8
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _fp8_unit(FP8: tl.constexpr):
    """What _fp8_as_fp16's value is short of the code's (2^8 for e4m3)."""
    if FP8 == 1:
        unit = 256.0
    else:
        unit = 1.0
    return unit


@triton.jit
def _load_fp8(cache, off, d, kv_mask, pmask, dtype: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    """A tile of fp8 K or V rows at byte offsets `off`: (the codes widened to `dtype`
    [tile, BD], their bf16 scales, the two bytes after the D codes, times _fp8_unit
    [tile]): value = widened code x scale."""
    codes = tl.load(cache + off[:, None] + d[None, :], mask=kv_mask, other=0)
    sb = tl.load((cache + off + D).to(tl.pointer_type(tl.uint16)), mask=pmask, other=0)
    s = sb.to(tl.bfloat16, bitcast=True).to(tl.float32) * _fp8_unit(FP8)
    return _fp8_as_fp16(codes, FP8).to(dtype), s


@triton.jit
def _attend_tile(q, k_cache, v_cache, table_row, pos, pmask, visible, kvh, d, dmask, m, l, acc, scale,  # noqa: E741
                 B: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    """Fold one tile of keys (token positions `pos`, read in place through the block
    table) into the running softmax state (max m, sum l, output acc) of the queries q.
    `visible` [rows, tile] masks what each query may see. fp8 (FP8 > 0): rows of
    D + 2 bytes; a key's scale multiplies its scores, a value's its weights
    (p x s_j, then the dot over the codes: sum_j p_j s_j v_j)."""
    ROW: tl.constexpr = D + _SCALE_BYTES if FP8 else D
    blk = tl.load(table_row + pos // B, mask=pmask, other=0).to(tl.int64)
    off = (blk * B + pos % B) * (KVH * ROW) + kvh * ROW
    kv_mask = pmask[:, None] & dmask[None, :]
    if FP8:
        k, ks = _load_fp8(k_cache, off, d, kv_mask, pmask, q.dtype, D, FP8)
        sc = tl.where(visible, _dot(q, tl.trans(k), IEEE) * (ks * scale)[None, :], float("-inf"))
    else:
        k = tl.load(k_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        sc = tl.where(visible, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    alpha = tl.exp(m - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)  # noqa: E741
    if FP8:  # weights p x s_j in bf16 (fp32 in IEEE mode): in fp16 a small V scale would underflow
        v, vs = _load_fp8(v_cache, off, d, kv_mask, pmask, tl.float32 if IEEE else tl.bfloat16, D, FP8)
        acc = acc * alpha[:, None] + _dot((p * vs[None, :]).to(v.dtype), v, IEEE)
    else:
        v = tl.load(v_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


# Arguments that change from step to step are not specialized on (Triton would otherwise
# compile a variant for each of "== 1", "% 16 == 0", "other": a stall mid-serving).
@triton.jit(do_not_specialize=["stride_tab", "max_parts", "window"])
def _decode_partition(q_ptr, k_cache, v_cache, tables, ctx_lens, m_out, l_out, acc_out, scale,
                      stride_tab, max_parts, window,
                      H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                      B: tl.constexpr, QG: tl.constexpr, BQ: tl.constexpr,
                      PART: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(ctx_lens + s)
    start = part * PART
    end = tl.minimum(start + PART, ctx)
    lo = tl.maximum(start, ctx - window)  # the row's oldest visible key: tiles below it are skipped
    g = tl.arange(0, BQ)
    gmask = g < QG
    qh = kvh * QG + g
    d = tl.arange(0, BD)
    dmask = d < D
    q = tl.load(q_ptr + s * H * D + qh[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BQ], float("-inf"), tl.float32)
    l = tl.zeros([BQ], tl.float32)  # noqa: E741
    acc = tl.zeros([BQ, BD], tl.float32)
    for t0 in range(start + (lo - start) // TILE * TILE, end, TILE):
        pos = t0 + tl.arange(0, TILE)
        pmask = (pos < end) & (pos >= lo)
        m, l, acc = _attend_tile(q, k_cache, v_cache, tables + s * stride_tab, pos, pmask,  # noqa: E741
                                 pmask[None, :], kvh, d, dmask, m, l, acc, scale, B, KVH, D, IEEE, FP8)
    base = (s * H + qh) * max_parts + part
    tl.store(m_out + base, m, mask=gmask)
    tl.store(l_out + base, l, mask=gmask)
    tl.store(acc_out + base[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["max_parts"])
def _decode_reduce(out_ptr, ctx_lens, m_out, l_out, acc_out, max_parts,
                   H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr, PART: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_lens + s)
    parts = tl.arange(0, BP)
    pm = (parts < (ctx + PART - 1) // PART) & (parts < max_parts)
    base = (s * H + h) * max_parts
    m = tl.load(m_out + base + parts, mask=pm, other=float("-inf"))
    l = tl.load(l_out + base + parts, mask=pm, other=0.0)  # noqa: E741
    gm = tl.max(m, 0)
    gm = tl.where(gm == float("-inf"), 0.0, gm)  # an empty sequence (padding row): output 0
    w = tl.where(pm, tl.exp(m - gm), 0.0)
    total = tl.sum(w * l, 0)
    d = tl.arange(0, BD)
    dmask = d < D
    acc = tl.load(acc_out + (base + parts)[:, None] * D + d[None, :], mask=pm[:, None] & dmask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (s * H + h) * D + d, o.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_context: int, out: torch.Tensor | None = None,
                 partition: int = PARTITION, tile: int | None = None, window: int = 0, kv: KVDtype | None = None,
                 **launch) -> torch.Tensor:
    """q [S, H, D]; block_tables [S, max_blocks] (int); context_lens [S] (0 = padding row);
    window: the sliding window (0: full attention); kv: the pools' fp8 kind (q rotated).
    `max_context` bounds every context_lens entry: it fixes the partition count, so a
    CUDA graph captured with max_model_len serves any length. `partition`, `tile` and
    `launch` (num_warps, num_stages) are for tuning sweeps (scripts/gpu_check.py)."""
    s, h, d = q.shape
    out = torch.empty_like(q) if out is None else out
    if s == 0:
        return out
    _, bs, kvh, _ = k_cache.shape
    qg = h // kvh
    part_size = max(partition, triton.next_power_of_2(triton.cdiv(max(max_context, 1), MAX_PARTS)))
    parts = max(1, triton.cdiv(max_context, part_size))
    m_out = torch.empty((s, h, parts), dtype=torch.float32, device=q.device)
    l_out = torch.empty_like(m_out)
    acc_out = torch.empty((s, h, parts, d), dtype=torch.float32, device=q.device)
    bd = _p2(d)
    ieee = q.dtype == torch.float32
    # fp32 (IEEE, no tensor cores) and fp8 (FP8_WARPS): half the tile, or ptxas spills
    # registers at head dim 128.
    tile = tile or (DECODE_TILE // 2 if ieee or kv is not None else DECODE_TILE)
    if kv is not None:
        launch.setdefault("num_warps", FP8_WARPS)
    _decode_partition[(s, kvh, parts)](
        q, k_cache, v_cache, block_tables, context_lens, m_out, l_out, acc_out, scale,
        block_tables.stride(0), parts, _window_arg(window), H=h, KVH=kvh, D=d, BD=bd, B=bs, QG=qg, BQ=_p2(qg),
        PART=part_size, TILE=tile, IEEE=ieee, FP8=_fp8_arg(kv), **launch)
    # BP fixed at MAX_PARTS (parts never exceed it): one compiled reduce for every length.
    _decode_reduce[(s, h)](out, context_lens, m_out, l_out, acc_out, parts, H=h, D=d, BD=bd,
                           BP=MAX_PARTS, PART=part_size)
    return out


@triton.jit(do_not_specialize=["stride_tab", "window"])
def _prefill(q_ptr, k_cache, v_cache, out_ptr, tables, stride_tab, tile_seq, tile_row,
             q_starts, q_lens, ctx_lens, scale, window,
             H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, B: tl.constexpr,
             QG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // QG
    sq = tl.load(tile_seq + tile)
    r0 = tl.load(tile_row + tile)
    qs = tl.load(q_starts + sq)
    ql = tl.load(q_lens + sq)
    ctx = tl.load(ctx_lens + sq)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < ql
    qpos = ctx - ql + rows  # absolute position of each query
    d = tl.arange(0, BD)
    dmask = d < D
    q = tl.load(q_ptr + (qs + rows)[:, None] * (H * D) + h * D + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)  # noqa: E741
    acc = tl.zeros([BM, BD], tl.float32)
    hi = tl.minimum(ctx, ctx - ql + r0 + BM)  # the tile's last query sees keys < hi
    lo = tl.maximum(ctx - ql + r0 - window + 1, 0)  # and its first none before lo: tiles below are skipped
    for n0 in range(lo // BN * BN, hi, BN):
        pos = n0 + tl.arange(0, BN)
        pmask = (pos < hi) & (pos >= lo)
        # causal by absolute position, and within each query's window
        visible = pmask[None, :] & (pos[None, :] <= qpos[:, None]) & (pos[None, :] > qpos[:, None] - window)
        m, l, acc = _attend_tile(q, k_cache, v_cache, tables + sq * stride_tab, pos, pmask, visible,  # noqa: E741
                                 kvh, d, dmask, m, l, acc, scale, B, KVH, D, IEEE, FP8)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (qs + rows)[:, None] * (H * D) + h * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


def prefill_tiles(q_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, first query row) of each PREFILL_M-row query tile."""
    seq, row = [], []
    for i, n in enumerate(q_lens):
        for r in range(0, n, PREFILL_M):
            seq.append(i)
            row.append(r)
    return (torch.tensor(seq, dtype=torch.int32, device=device),
            torch.tensor(row, dtype=torch.int32, device=device))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                  ctx_lens: torch.Tensor, tiles: tuple[torch.Tensor, torch.Tensor], scale: float,
                  window: int = 0, kv: KVDtype | None = None) -> None:
    """Rows q[q_starts[i] : q_starts[i] + q_lens[i]] of sequence i sit at absolute positions
    ctx_lens[i] - q_lens[i] ...; each attends to keys 0..its position through block_tables[i]
    (only the last `window` of them, if window > 0). kv: the pools' fp8 kind (q rotated)."""
    n_tiles = tiles[0].numel()
    if n_tiles == 0:
        return
    _, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    ieee = q.dtype == torch.float32
    # fp32: smaller key tiles, more warps, no register spills; fp8: more warps (FP8_WARPS)
    warps = 8 if ieee else FP8_WARPS if kv is not None else 4
    _prefill[(n_tiles, h)](q, k_cache, v_cache, out, block_tables, block_tables.stride(0), tiles[0], tiles[1],
                           q_starts, q_lens, ctx_lens, scale, _window_arg(window), H=h, KVH=kvh, D=d, BD=_p2(d), B=bs,
                           QG=h // kvh, BM=PREFILL_M, BN=PREFILL_N // 2 if ieee else PREFILL_N, IEEE=ieee,
                           FP8=_fp8_arg(kv), num_warps=warps)
