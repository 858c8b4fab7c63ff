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

On a machine without CUDA these run under Triton's interpreter (TRITON_INTERPRET=1, set
here before the kernels are defined), which is how the tests check them on CPU.
"""
from __future__ import annotations

import os

import torch

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
                      slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] (rows may be strided, each row contiguous) -> their slots."""
    t, kvh, d = k.shape
    if t == 0:
        return
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
def _attend_tile(q, k_cache, v_cache, table_row, pos, pmask, visible, kvh, d, dmask, m, l, acc, scale,  # noqa: E741
                 B: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    """Fold one tile of keys (token positions `pos`, read in place through the block
    table) into the running softmax state (max m, sum l, output acc) of the queries q.
    `visible` [rows, tile] masks what each query may see."""
    blk = tl.load(table_row + pos // B, mask=pmask, other=0).to(tl.int64)
    off = (blk * B + pos % B) * (KVH * D) + kvh * D
    kv_mask = pmask[:, None] & dmask[None, :]
    k = tl.load(k_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    sc = tl.where(visible, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    alpha = tl.exp(m - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)  # noqa: E741
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
                      PART: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
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
                                 pmask[None, :], kvh, d, dmask, m, l, acc, scale, B, KVH, D, IEEE)
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
                 partition: int = PARTITION, tile: int | None = None, window: int = 0, **launch) -> torch.Tensor:
    """q [S, H, D]; block_tables [S, max_blocks] (int); context_lens [S] (0 = padding row);
    window: the sliding window (0: full attention).
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
    # fp32 (IEEE, no tensor cores): half the tile, or ptxas spills registers at head dim 128.
    tile = tile or (DECODE_TILE // 2 if ieee else DECODE_TILE)
    _decode_partition[(s, kvh, parts)](
        q, k_cache, v_cache, block_tables, context_lens, m_out, l_out, acc_out, scale,
        block_tables.stride(0), parts, _window_arg(window), H=h, KVH=kvh, D=d, BD=bd, B=bs, QG=qg, BQ=_p2(qg),
        PART=part_size, TILE=tile, IEEE=ieee, **launch)
    # BP fixed at MAX_PARTS (parts never exceed it): one compiled reduce for every length.
    _decode_reduce[(s, h)](out, context_lens, m_out, l_out, acc_out, parts, H=h, D=d, BD=bd,
                           BP=MAX_PARTS, PART=part_size)
    return out


@triton.jit(do_not_specialize=["stride_tab", "window"])
def _prefill(q_ptr, k_cache, v_cache, out_ptr, tables, stride_tab, tile_seq, tile_row,
             q_starts, q_lens, ctx_lens, scale, window,
             H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, B: tl.constexpr,
             QG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
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
                                 kvh, d, dmask, m, l, acc, scale, B, KVH, D, IEEE)
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
                  window: int = 0) -> None:
    """Rows q[q_starts[i] : q_starts[i] + q_lens[i]] of sequence i sit at absolute positions
    ctx_lens[i] - q_lens[i] ...; each attends to keys 0..its position through block_tables[i]
    (only the last `window` of them, if window > 0)."""
    n_tiles = tiles[0].numel()
    if n_tiles == 0:
        return
    _, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    ieee = q.dtype == torch.float32
    _prefill[(n_tiles, h)](q, k_cache, v_cache, out, block_tables, block_tables.stride(0), tiles[0], tiles[1],
                           q_starts, q_lens, ctx_lens, scale, _window_arg(window), H=h, KVH=kvh, D=d, BD=_p2(d), B=bs,
                           QG=h // kvh, BM=PREFILL_M, BN=PREFILL_N // 2 if ieee else PREFILL_N, IEEE=ieee,
                           num_warps=8 if ieee else 4)  # fp32: smaller key tiles, more warps, no register spills
