"""Reference paged attention in plain torch: gathers K/V through block tables and
runs scaled_dot_product_attention. Runs anywhere torch runs.

Quantized pools (--kv-cache-dtype int8/fp8/int4) hold kv_quant's rows (codes, then bf16
scales) in the base class's layout: each new token is quantized into its slot, and the
gathered blocks are dequantized to the query's dtype before the same SDPA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dataclasses import dataclass, field

from ..kv_dtype import KVDtype
from ..util import cdiv
from . import kv_quant
from .backend import AttentionBackend, SplitMetadata, StepLayout, register


@dataclass
class TorchMetadata(SplitMetadata):
    # Decode rows come sorted by context length; these (start, end, max context) groups
    # pad each group only to its own longest context.
    decode_groups: list[tuple[int, int, int]] = field(default_factory=list)
    # The rows that write their K/V, when some do not (slot -1: padding, or a row re-read
    # over a prefix hit's KV); None when all do. Found once a step, not in every layer.
    write_rows: torch.Tensor | None = None


def length_groups(lens: list[int], size: int) -> list[tuple[int, int, int]]:
    """(start, end, max length) for consecutive groups of `size` lengths (the runner sorts
    decodes by context, so a group's rows pad to similar lengths)."""
    return [(i, min(i + size, len(lens)), max(lens[i:i + size])) for i in range(0, len(lens), size)]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, rows: torch.Tensor | None = None, kv: KVDtype | None = None) -> None:
    """Each row's K/V into its slot; `rows`: only these rows (the others have slot -1).
    kv: the pools' quantized kind (each row quantized alone into its slot), None: plain."""
    if rows is not None:
        k, v, slot_mapping = k[rows], v[rows], slot_mapping[rows]
    if kv is not None:
        k, v = kv_quant.quantize(k, kv, key=True), kv_quant.quantize(v, kv)
    for new, cache in ((k, k_cache), (v, v_cache)):  # K's and V's rows differ in size (int4)
        write_rows(new, cache, slot_mapping)


def write_rows(new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Each row of `new` [T, KVH, row] into its slot of a [blocks, B, KVH, row] pool."""
    nb, bs, kvh, row = cache.shape
    cache.view(nb * bs, kvh, row).index_copy_(0, slot_mapping, new)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows of whole blocks, in block-table order. index_select over a 2-D view copies
    each block as one contiguous row, several times faster on CPU than fancy indexing."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))


def _dequantized(cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor, kv: KVDtype, dtype: torch.dtype,
                 key: bool) -> torch.Tensor:
    """Decode rows' blocks of a quantized pool as values [n, positions, KVH, D]. Rows the
    mask hides (past a context, in a padding block) are zeroed as bytes first: stale bytes
    can decode to NaN or inf (fp8 0x7f, a bf16 scale 0xffff), and SDPA's masked weight 0
    times NaN is NaN; zero codes and zero scales decode to 0 in every kind."""
    rows = gather_blocks(cache, tables).view(mask.shape[0], -1, *cache.shape[2:])  # a copy: zeroed in place
    return kv_quant.dequantize(rows.mul_(mask[:, :, None, None]), kv, dtype, key)


@register
class TorchPagedAttention(AttentionBackend):
    name = "torch"
    kv_dtypes = ("int8", "fp8_e4m3", "fp8_e5m2", "int4")
    latent = True
    sinks = True

    def __init__(self, decode_group: int = 24) -> None:
        # Decodes attend in groups this size: padding each group only to its own longest
        # context, and keeping a group's K/V within cache, was ~4x faster on a 2-core CPU
        # than one batch of 100 padded to the longest.
        self.decode_group = decode_group

    def build_metadata(self, layout: StepLayout, device) -> TorchMetadata:
        lens = layout.seq_lens[:layout.num_decodes]
        rows = None
        if min(layout.slots, default=0) < 0:
            rows = torch.tensor([i for i, s in enumerate(layout.slots) if s >= 0], dtype=torch.long, device=device)
        return TorchMetadata.from_layout(layout, device, decode_groups=length_groups(lens, self.decode_group),
                                         write_rows=rows)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float, window: int = 0, sinks=None):
        # All new K/V of the step land in the pool before anyone reads it, so a request
        # that hit a prefix block filled in this same step reads it complete.
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.write_rows, self.kv)
        out = torch.empty_like(q)
        for start, end, max_ctx in meta.decode_groups or [(0, meta.num_decodes, meta.decode_max_context)]:
            if end > start:
                out[start:end] = self._decode(q[start:end], k_cache, v_cache,
                                              meta.decode_block_tables[start:end],
                                              meta.decode_context_lens[start:end], max_ctx, scale, window, self.kv,
                                              sinks)
        for p in meta.prefills:
            out[p.q_start:p.q_start + p.q_len] = self._prefill(
                q[p.q_start:p.q_start + p.q_len], k_cache, v_cache, p.block_table, p.ctx_len, scale, window,
                self.kv, sinks)
        return out

    def forward_latent(self, q, latent, cache, meta: TorchMetadata, scale: float, v_dim: int):
        if self.kv is not None:
            raise ValueError("multi-head latent attention keeps its latent unquantized (kv_cache_dtype auto)")
        rows = meta.write_rows
        write_rows(latent if rows is None else latent[rows], cache,
                   meta.slot_mapping if rows is None else meta.slot_mapping[rows])
        out = q.new_empty(*q.shape[:2], v_dim)
        for start, end, max_ctx in meta.decode_groups or [(0, meta.num_decodes, meta.decode_max_context)]:
            if end > start:
                out[start:end] = latent_decode(q[start:end], cache, meta.decode_block_tables[start:end],
                                                meta.decode_context_lens[start:end], max_ctx, scale, v_dim)
        for p in meta.prefills:
            out[p.q_start:p.q_start + p.q_len] = latent_prefill(q[p.q_start:p.q_start + p.q_len], cache,
                                                                 p.block_table, p.ctx_len, scale, v_dim)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, tables, context_lens, max_ctx: int, scale: float, window: int = 0,
                kv: KVDtype | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        n, bs, kvh, d = q.shape[0], k_cache.shape[1], k_cache.shape[2], q.shape[2]
        nblk = cdiv(max_ctx, bs)
        tables = tables[:, :nblk]
        ctx = context_lens[:, None]
        if 0 < window < max_ctx:
            # Each row reads only the blocks of its window: keys ctx - W .. ctx - 1, at most
            # cdiv(W - 1, B) + 1 blocks from the one holding ctx - W. Entries before it may
            # be -1 (released) and are never read; past the table they are masked.
            span = min(nblk, cdiv(window - 1, bs) + 1)
            first = (context_lens.long() - window).clamp(min=0) // bs
            idx = first[:, None] + torch.arange(span, device=q.device)
            tables = tables.gather(1, idx.clamp(max=nblk - 1)).clamp(min=0)
            pos = (idx[:, :, None] * bs + torch.arange(bs, device=q.device)).view(n, -1)
            mask = (pos < ctx) & (pos >= ctx - window)
        else:
            span = nblk
            pos = torch.arange(nblk * bs, device=q.device)[None, :]
            mask = pos < ctx
        if kv is None:
            keys = gather_blocks(k_cache, tables).view(n, span * bs, kvh, d).transpose(1, 2)
            vals = gather_blocks(v_cache, tables).view(n, span * bs, kvh, d).transpose(1, 2)
        else:
            keys, vals = (_dequantized(cache, tables, mask, kv, q.dtype, key).transpose(1, 2)
                          for cache, key in ((k_cache, True), (v_cache, False)))
        return attend(q.unsqueeze(2), keys, vals, mask.view(n, 1, 1, -1), scale, sinks).squeeze(2)

    @staticmethod
    def _prefill(q, k_cache, v_cache, table, ctx: int, scale: float, window: int = 0,
                 kv: KVDtype | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        bs, kvh, d = k_cache.shape[1], k_cache.shape[2], q.shape[2]
        ql = q.shape[0]
        # Keys from the block holding the first query's oldest visible key (position
        # ctx - ql - W + 1): the blocks before it may be -1 (released).
        lo = max(0, ctx - ql - window + 1) // bs * bs if window else 0
        if lo:
            table = table[lo // bs:]
        if window:
            table = table.clamp(min=0)
        if kv is None:
            keys = gather_blocks(k_cache, table).view(-1, kvh, d)[:ctx - lo].transpose(0, 1)
            vals = gather_blocks(v_cache, table).view(-1, kvh, d)[:ctx - lo].transpose(0, 1)
        else:  # keys lo .. ctx - 1 were all written: no stale row is dequantized
            rows = [gather_blocks(c, table).view(-1, *c.shape[2:])[:ctx - lo] for c in (k_cache, v_cache)]
            keys = kv_quant.dequantize(rows[0], kv, q.dtype, key=True).transpose(0, 1)
            vals = kv_quant.dequantize(rows[1], kv, q.dtype).transpose(0, 1)
        if ctx == ql and not window and sinks is None:
            o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, is_causal=True,
                                               scale=scale, enable_gqa=True)
        else:
            # Query i sits at absolute position ctx - ql + i and sees keys up to it (and,
            # windowed, none W or more before it).
            qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
            kpos = torch.arange(lo, ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if window:
                mask &= kpos > qpos - window
            o = attend(q.transpose(0, 1), keys, vals, mask, scale, sinks)
        return o.transpose(0, 1)


_SINK_SCORES = 1 << 24   # score elements a query slice of attend() holds, with sinks, at once (64 MiB of float32)


def attend(q, keys, vals, mask, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [..., H, Lq, D] over keys / vals [..., KVH, Lk, D] where the bool mask
    (broadcast to [..., H, Lq, Lk]) allows: SDPA's, or with sinks [H] the softmax in float32 over
    each row's scores and its head's sink logit, the sink's share attending to nothing (gpt-oss)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
    *lead, h, lq, d = q.shape
    kvh, lk = keys.shape[-3], keys.shape[-2]
    g = h // kvh
    out = torch.empty_like(q)
    step = max(1, _SINK_SCORES // max(1, h * lk * (q.numel() // (h * lq * d))))
    keys_t, vals_f = keys.float().transpose(-1, -2), vals.float()
    sink = sinks.float().view(h, 1, 1)
    for q0 in range(0, lq, step):
        q1 = min(lq, q0 + step)
        n = q1 - q0
        qs = q[..., q0:q1, :].float().reshape(*lead, kvh, g * n, d)   # a KV head's query heads as rows of one matmul
        scores = torch.matmul(qs, keys_t).mul_(scale).view(*lead, h, n, lk)
        scores.masked_fill_(~mask[..., q0:q1, :] if mask.shape[-2] == lq else ~mask, float("-inf"))
        full = torch.cat([scores, sink.expand(*lead, h, n, 1)], dim=-1).softmax(dim=-1)[..., :lk]
        out[..., q0:q1, :] = torch.matmul(full.reshape(*lead, kvh, g * n, lk), vals_f).view(*lead, h, n, d)
    return out


# Multi-head latent attention: every head reads the one latent head, so the heads are query rows of
# one matmul against the sequence's keys (no per-head copies of K, as SDPA's grouped path makes),
# the softmax in float32, each key's first v_dim dims its value.
_LATENT_SCORES = 1 << 25   # score elements a prefill slice holds at once (128 MiB of float32)


def latent_decode(q, cache, tables, context_lens, max_ctx: int, scale: float, v_dim: int) -> torch.Tensor:
    """q [n, H, D], one query row per sequence: [n, H, v_dim]."""
    n, d, bs = q.shape[0], q.shape[2], cache.shape[1]
    nblk = cdiv(max_ctx, bs)
    keys = gather_blocks(cache, tables[:, :nblk]).view(n, nblk * bs, d)
    scores = torch.bmm(q, keys.transpose(1, 2)).float().mul_(scale)
    past = torch.arange(nblk * bs, device=q.device)[None, :] >= context_lens[:, None]
    probs = scores.masked_fill_(past[:, None, :], float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.bmm(probs, keys[..., :v_dim])


def latent_rows(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """[n, D]: a sequence's first n latent rows, through its block table (only the blocks they fill)."""
    return gather_blocks(cache, table[:cdiv(n, cache.shape[1])]).view(-1, cache.shape[-1])[:n]


def latent_prefill(q, cache, table, ctx: int, scale: float, v_dim: int) -> torch.Tensor:
    """q [ql, H, D], the last ql of ctx positions, each seeing the keys up to its own: [ql, H, v_dim]."""
    ql, h, d = q.shape
    keys = latent_rows(cache, table, ctx)
    out = q.new_empty(ql, h, v_dim)
    rows = max(1, _LATENT_SCORES // (h * ctx))
    kpos = torch.arange(ctx, device=q.device)[None, :]
    for a in range(0, ql, rows):
        b = min(ql, a + rows)
        scores = (q[a:b].reshape(-1, d) @ keys.T).float().mul_(scale).view(b - a, h, ctx)
        later = kpos > torch.arange(ctx - ql + a, ctx - ql + b, device=q.device)[:, None]
        probs = scores.masked_fill_(later[:, None, :], float("-inf")).softmax(dim=-1).to(q.dtype)
        out[a:b] = (probs.view(-1, ctx) @ keys[:, :v_dim]).view(b - a, h, v_dim)
    return out
