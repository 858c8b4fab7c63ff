"""Multi-head latent attention (DeepSeek-V2/V3) over the paged pool.

A token's keys and values are made from one latent c (kv_lora_rank values, normed) and one rotary
key k_pe (rope_dim values) that every head shares: head h's key is [W_UK[h] c, k_pe] and its
value W_UV[h] c. The pool keeps only [c, k_pe] a token (mla_config.MLAConfig.latent values a
layer; K rows of one KV head, V rows of none), and attention runs on it directly, with the
up-projections absorbed (as vLLM's MLA backends and DeepSeek's own decode do):

    q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe     (the query moved into latent space)
    out_h     = W_UV[h] (sum_j p_j c_j)                       (values summed as latents, then expanded)

so every head attends to the same single-head pool of [c, k_pe] rows, its value the first
kv_lora_rank dims of each key. The cost per key is the latent's width, not heads x head dims,
which is what keeps a 128-head model's cache 70x smaller than its expanded K/V.

A prefill chunk of many rows runs the other way round, as vLLM's MLA prefill and HF transformers
do: its keys' latents (its own, and those before it read back from the pool) up-projected to full
heads (W_UK c, W_UV c), then causal attention over them on torch's flash attention. Each
query-key pair then costs nope + rope + v dims (320 for DeepSeek, 384 padded) instead of the
latent's rank + rope + rank (1,088); up-projecting the chunk's own keys costs what absorbing its
queries and expanding its outputs would, and those before it are paid for once the chunk has
more rows than ~190 keys' worth (_expanded_chunks). Its latents are written to the pool all the
same: decodes and short chunks read them there."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..attention.fresh_prefill import sdpa_chunk
from .config import ModelConfig
from .norm import RMSNorm
from .ops import Ops


class KVUpProjection(nn.Module):
    """kv_b_proj's weight [heads x (nope + v), kv_lora_rank], as the checkpoint holds it (not an
    nn.Linear: it is never run as one, so quantization and prepacking leave it alone). Read as
    each head's W_UK [nope, rank] and W_UV^T [rank, v], made contiguous once per dtype."""

    def __init__(self, heads: int, nope: int, v: int, rank: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v = heads, nope, v
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), rank), requires_grad=False)
        self._parts: tuple[Any, torch.Tensor, torch.Tensor] | None = None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV^T [heads, rank, v]) of the current weight."""
        w = self.weight
        key = (w.data_ptr(), w.dtype)
        if self._parts is None or self._parts[0] != key:
            per_head = w.view(self.heads, self.nope + self.v, -1)
            self._parts = (key, per_head[:, :self.nope].contiguous(),
                           per_head[:, self.nope:].transpose(1, 2).contiguous())
        return self._parts[1], self._parts[2]


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        m = cfg.mla
        self.m, self.h = m, cfg.num_heads
        qk = m.nope_dim + m.rope_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, m.latent, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = KVUpProjection(self.h, m.nope_dim, m.v_dim, m.kv_lora_rank)
        self.o_proj = nn.Linear(self.h * m.v_dim, cfg.hidden_size, bias=cfg.qkv_bias)
        self.backend = backend
        self.scale = cfg.scale   # of the full heads' q.k (nope + rope dims), YaRN's mscale folded in

    def forward(self, x, ops: Ops, rotate, k_cache, v_cache, meta: Any):
        t, m, h = x.shape[0], self.m, self.h
        r = m.kv_lora_rank
        if m.q_lora_rank:
            q = ops.linear(self.q_b_proj, ops.norm(ops.linear(self.q_a_proj, x), self.q_a_layernorm))
        else:
            q = ops.linear(self.q_proj, x)
        q = q.view(t, h, m.nope_dim + m.rope_dim)
        kv = ops.linear(self.kv_a_proj_with_mqa, x)
        q_pe, k_pe = rotate(q[..., m.nope_dim:].contiguous(), kv[:, r:].contiguous().view(t, 1, m.rope_dim))
        latent = torch.cat([ops.norm(kv[:, :r].contiguous(), self.kv_a_layernorm).view(t, 1, r), k_pe], dim=-1)
        chunks = self._expanded_chunks(self.backend.latent_chunks(meta))
        a = chunks[0][1] if chunks else t   # the rows before those chunks attend in latent space
        w_uk, w_uv_t = self.kv_b_proj.parts()
        # each head's query in latent space: q_nope_h W_UK[h] ([t, nope] x [nope, rank]), then its rotary part
        q_lat = torch.bmm(q[:a, :, :m.nope_dim].transpose(0, 1), w_uk)
        query = torch.cat([q_lat.transpose(0, 1), q_pe[:a]], dim=-1)
        o = self.backend.forward_latent(query, latent, k_cache, meta, self.scale, r)   # [a, h, rank]; writes all t
        o = torch.bmm(o.transpose(0, 1), w_uv_t).transpose(0, 1)   # each head's value: its summed latent through W_UV[h]
        if chunks:
            o = torch.cat([o, self._expanded(q[a:], q_pe[a:], latent[a:], k_cache, meta, chunks, a)])
        return ops.linear(self.o_proj, o.reshape(t, h * m.v_dim))

    def _expanded_chunks(self, chunks: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
        """Of the step's prefill chunks (sequence, first row, rows L, keys S), the trailing run that
        costs fewer flops on expanded heads: up-projecting the S - L keys before the chunk (its own
        L are projected either way, as its queries would be absorbed and its outputs expanded)
        against the wider dot products of every query-key pair in latent space. A chunk with no keys
        before it always; one of a few rows (a decode-like tail) after many keys never."""
        m = self.m
        up = m.kv_lora_rank * (m.nope_dim + m.v_dim)   # a key's up-projection, per head
        per_pair = 2 * m.kv_lora_rank + m.rope_dim - 2 * max(m.nope_dim + m.rope_dim, m.v_dim)
        i = len(chunks)
        while i and (chunks[i - 1][3] - chunks[i - 1][2]) * up < chunks[i - 1][2] * chunks[i - 1][3] * per_pair:
            i -= 1
        return chunks[i:]

    def _expanded(self, q, q_pe, latent, cache, meta: Any, chunks: list[tuple[int, int, int, int]],
                  first: int) -> torch.Tensor:
        """[rows, h, v] for the step's rows from `first` on: each chunk's causal attention on full
        heads over its keys (those before it read back from the pool), every key and value
        up-projected from its latent; rows after the last chunk (padding) zero."""
        m, h = self.m, self.h
        r, nope, w = m.kv_lora_rank, m.nope_dim, self.kv_b_proj.weight
        own = F.linear(latent[:, 0, :r], w).view(-1, h, nope + m.v_dim)   # the step's own rows, at once
        # torch's CPU flash attention takes one head dim for q, k and v (others run its ~4x slower
        # math path): the narrower side padded with zeros, which add nothing to a dot product
        # (the scale is given) nor to an output column that is cut off
        width = max(nope + m.rope_dim, m.v_dim)
        out = q.new_zeros(q.shape[0], h, m.v_dim)
        for seq, start, n, keys in chunks:
            i = start - first
            kv, pe = own[i:i + n], latent[i:i + n, :, r:]
            if keys > n:   # the keys before the chunk, from the pool (the chunk's own were just written)
                before = self.backend.latent_keys(cache, meta, seq, keys - n)
                kv = torch.cat([F.linear(before[:, :r], w).view(-1, h, nope + m.v_dim), kv])
                pe = torch.cat([before[:, None, r:], pe])
            k_full = torch.cat([kv[..., :nope], pe.expand(-1, h, m.rope_dim)], dim=-1)
            q_full = torch.cat([q[i:i + n, :, :nope], q_pe[i:i + n]], dim=-1)
            pad = width - k_full.shape[-1]
            values = F.pad(kv[..., nope:], (0, width - m.v_dim))
            out[i:i + n] = sdpa_chunk(F.pad(q_full, (0, pad)), F.pad(k_full, (0, pad)), values, self.scale)[..., :m.v_dim]
        return out
