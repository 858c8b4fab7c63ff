"""A prefill chunk with no keys before it (a fresh prompt, or a prompt's first chunk) on torch's
CPU flash attention, where that is faster here.

Such a chunk attends only to its own rows: it needs no block table, and its queries, keys and
values are the step's own tensors. `F.scaled_dot_product_attention` runs it as tile products
(QK^T and PV on `cpublas::brgemm`, which uses AMX for bf16 where the CPU has it); the paged
kernel runs it as it runs every chunk, reading the keys back from their blocks. Which wins
depends on the CPU and the chunk's length, so the kernel chooser times both per head shape at
first use (kernels/chooser.py) and the CPU backend routes each fresh chunk by its length. The
chunk's K/V are written to their blocks either way: later steps read them there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.chooser import Candidate, Route, Verdict, chooser, dtype_name

CHUNKS = (16, 64, 256, 1024)   # chunk lengths timed: a short prompt, a chat turn, a document
POOL_BLOCK = 16


def sdpa_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one chunk: q [L, H, D] the last L of k, v's S positions [S, KVH, D], query
    i seeing keys up to S - L + i (a fresh chunk: S = L, torch's causal mask)."""
    n, s = q.shape[0], k.shape[0]
    mask = None if n == s else \
        torch.arange(s, device=q.device)[None, :] <= torch.arange(s - n, s, device=q.device)[:, None]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o.squeeze(0).transpose(0, 1)


def fresh_route(ops, backend, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Route:
    """Per chunk length: "paged" (the backend's kernel) or "sdpa" (torch's flash attention),
    timed on this machine for this head shape and dtype."""
    return fresh_verdict(ops, backend, heads, kv_heads, head_dim, dtype).route


def fresh_verdict(ops, backend, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Verdict:
    """fresh_route's timings (for `pagedllm env`)."""
    steps: dict[int, tuple] = {}   # a chunk's pool and metadata, made once per length

    def paged(_layout, x):
        q, k, v = x
        m = q.shape[0]
        if m not in steps:
            nb = -(-m // POOL_BLOCK)
            kc, vc = (torch.zeros(s, dtype=dtype) for s in backend.cache_shapes(nb, POOL_BLOCK, kv_heads, head_dim, dtype))
            ops.write_kv(k, v, kc, vc, torch.arange(m), 0)
            steps[m] = (kc, vc, torch.arange(nb, dtype=torch.int32)[None], torch.tensor([m], dtype=torch.int32),
                        torch.tensor([0, m], dtype=torch.int32))
        kc, vc, tables, lens, starts = steps[m]
        ops.paged_attention(torch.empty_like(q), q, kc, vc, tables, lens, starts, head_dim ** -0.5, True, 0, 0, 0)

    def make_input(m: int):
        g = torch.Generator().manual_seed(m)
        return tuple(torch.randn(m, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))

    cands = [Candidate("paged", lambda w: w, paged),
             Candidate("sdpa", lambda w: w, lambda _w, x: sdpa_chunk(*x, head_dim ** -0.5))]
    # A causal chunk of m rows: m^2 / 2 query-key pairs, 4 H D flops each (QK^T and PV)
    return chooser().choose(f"fresh-prefill-{dtype_name(dtype)}", (heads, kv_heads, head_dim),
                            2 * heads * head_dim, cands, lambda g: None, 1 << 40, make_input, CHUNKS, power=2,
                            sources=("attention.cpp",))
