"""Paged attention (K/V read through block tables) equals plain contiguous attention."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import StepLayout, get_backend

H, KVH, D = 6, 2, 16


def reference(q, k, v, scale):
    """Causal attention of the last q.shape[0] positions over contiguous k/v, GQA by repeat."""
    ql, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(ctx - ql, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [None, 2])
def test_paged_equals_contiguous(block_size, dtype, group):
    g = torch.Generator().manual_seed(block_size)
    # (cached prefix, new tokens): decodes, a fresh prefill, prefills over a cached prefix.
    seqs = [(40, 1), (7, 1), (0, 1), (0, 23), (33, 9), (64, 64), (5, 2)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_cache = torch.randn(num_blocks, block_size, KVH, D, generator=g).to(dtype)  # stale data
    v_cache = torch.randn(num_blocks, block_size, KVH, D, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    full_k, full_v, tables = [], [], []
    for cached, new in seqs:
        n = cached + new
        table = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(table)
        full_k.append(torch.randn(n, KVH, D, generator=g).to(dtype))
        full_v.append(torch.randn(n, KVH, D, generator=g).to(dtype))
        for j in range(cached):  # the prefix's KV is already in the pool
            k_cache[table[j // block_size], j % block_size] = full_k[-1][j]
            v_cache[table[j // block_size], j % block_size] = full_v[-1][j]
    # Decodes first, shortest context first (the runner's order).
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i][1] != 1, sum(seqs[i])))
    qs, ks, vs, slots, lens, starts = [], [], [], [], [], [0]
    for i in order:
        cached, new = seqs[i]
        n = cached + new
        qs.append(torch.randn(new, H, D, generator=g).to(dtype))
        ks.append(full_k[i][cached:])
        vs.append(full_v[i][cached:])
        slots += [tables[i][j // block_size] * block_size + j % block_size for j in range(cached, n)]
        lens.append(n)
        starts.append(starts[-1] + new)
    layout = StepLayout(slots, [tables[i] for i in order], lens, starts, sum(1 for i in order if seqs[i][1] == 1))
    backend = get_backend("torch")
    backend.decode_group = group or len(seqs)  # None: all decodes in one group
    q = torch.cat(qs)
    out = backend.forward(q, torch.cat(ks), torch.cat(vs), k_cache, v_cache, backend.build_metadata(layout, "cpu"),
                          D ** -0.5)
    row = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, qi in zip(order, qs):
        want = reference(qi.float(), full_k[i].float(), full_v[i].float(), D ** -0.5)
        torch.testing.assert_close(out[row:row + len(qi)].float(), want, atol=tol, rtol=tol)
        row += len(qi)
