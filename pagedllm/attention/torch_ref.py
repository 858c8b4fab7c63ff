"""Reference paged attention in plain torch: gathers K/V through block tables and
runs scaled_dot_product_attention. Runs anywhere torch runs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dataclasses import dataclass, field

from ..util import cdiv
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
             slot_mapping: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Each row's K/V into its slot; `rows`: only these rows (the others have slot -1)."""
    nb, bs, kvh, d = k_cache.shape
    if rows is not None:
        k, v, slot_mapping = k[rows], v[rows], slot_mapping[rows]
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows of whole blocks, in block-table order. index_select over a 2-D view copies
    each block as one contiguous row, several times faster on CPU than fancy indexing."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))


@register
class TorchPagedAttention(AttentionBackend):
    name = "torch"

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

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float, window: int = 0):
        # All new K/V of the step land in the pool before anyone reads it, so a request
        # that hit a prefix block filled in this same step reads it complete.
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.write_rows)
        out = torch.empty_like(q)
        for start, end, max_ctx in meta.decode_groups or [(0, meta.num_decodes, meta.decode_max_context)]:
            if end > start:
                out[start:end] = self._decode(q[start:end], k_cache, v_cache,
                                              meta.decode_block_tables[start:end],
                                              meta.decode_context_lens[start:end], max_ctx, scale, window)
        for p in meta.prefills:
            out[p.q_start:p.q_start + p.q_len] = self._prefill(
                q[p.q_start:p.q_start + p.q_len], k_cache, v_cache, p.block_table, p.ctx_len, scale, window)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, tables, context_lens, max_ctx: int, scale: float, window: int = 0) -> torch.Tensor:
        n, bs, kvh, d = q.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
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
        keys = gather_blocks(k_cache, tables).view(n, span * bs, kvh, d).transpose(1, 2)
        vals = gather_blocks(v_cache, tables).view(n, span * bs, kvh, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask.view(n, 1, 1, -1),
                                           scale=scale, enable_gqa=True)
        return o.squeeze(2)

    @staticmethod
    def _prefill(q, k_cache, v_cache, table, ctx: int, scale: float, window: int = 0) -> torch.Tensor:
        bs, kvh, d = k_cache.shape[1:]
        ql = q.shape[0]
        # Keys from the block holding the first query's oldest visible key (position
        # ctx - ql - W + 1): the blocks before it may be -1 (released).
        lo = max(0, ctx - ql - window + 1) // bs * bs if window else 0
        if lo:
            table = table[lo // bs:]
        if window:
            table = table.clamp(min=0)
        keys = gather_blocks(k_cache, table).view(-1, kvh, d)[:ctx - lo].transpose(0, 1)
        vals = gather_blocks(v_cache, table).view(-1, kvh, d)[:ctx - lo].transpose(0, 1)
        if ctx == ql and not window:
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
            o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, attn_mask=mask,
                                               scale=scale, enable_gqa=True)
        return o.transpose(0, 1)
