"""Paged attention (K/V read through block tables) equals plain contiguous attention."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import StepLayout, get_backend
from pagedllm.attention.kv_quant import dequantize, quantize
from pagedllm.kv_dtype import KV_DTYPES

H, KVH, D = 6, 2, 16


def reference(q, k, v, scale, window: int = 0):
    """Causal attention of the last q.shape[0] positions over contiguous k/v, GQA by repeat;
    with a window W, query p sees only keys p - W < j <= p."""
    ql, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(ctx - ql, ctx)[:, None]
    j = torch.arange(ctx)[None, :]
    hide = (j > qpos) | (j <= qpos - window) if window else j > qpos
    scores = scores.masked_fill(hide, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (cached prefix, new tokens): decodes, a fresh prefill, prefills over a cached prefix.
SEQS = [(40, 1), (7, 1), (0, 1), (0, 23), (33, 9), (64, 64), (5, 2)]


def write_prefix(backend, k, v, k_cache, v_cache, slots) -> None:
    if backend.name == "cpu":
        backend.ops.write_kv(k, v, k_cache, v_cache, slots)
    else:
        from pagedllm.attention.torch_ref import write_kv
        write_kv(k, v, k_cache, v_cache, slots, kv=backend.kv)


def run_paged(backend, block_size: int, dtype, window: int = 0, seqs=SEQS, seed: int = 0, head_dim: int = D):
    """The step of `seqs` through `backend`, against the reference. Under a window each
    table's entries below its first query's window are -1 (released), and the blocks they
    held are overwritten with huge values: read once, they would swamp the result.
    A backend storing a quantized kind (backend.kv) is held to attention over the values
    its rows dequantize to; its stale bytes are random (NaN codes and scales among them),
    and its released blocks all 0xff (NaN in fp8, and in a bf16 scale)."""
    g = torch.Generator().manual_seed(block_size + seed)
    kv = backend.kv
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_shape, v_shape = backend.cache_shapes(num_blocks, block_size, KVH, head_dim, dtype)  # each backend's own layout
    if kv is None:
        k_cache = torch.randn(k_shape, generator=g).to(dtype)  # stale data
        v_cache = torch.randn(v_shape, generator=g).to(dtype)
    else:
        k_cache = torch.randint(0, 256, k_shape, generator=g, dtype=torch.uint8)
        v_cache = torch.randint(0, 256, v_shape, generator=g, dtype=torch.uint8)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    full_k, full_v, tables = [], [], []
    for cached, new in seqs:
        n = cached + new
        table = [free.pop() for _ in range(-(-n // block_size))]
        full_k.append(torch.randn(n, KVH, head_dim, generator=g).to(dtype))
        full_v.append(torch.randn(n, KVH, head_dim, generator=g).to(dtype))
        if cached:  # the prefix's KV is already in the pool, written by the backend's own writer
            pre = torch.tensor([table[j // block_size] * block_size + j % block_size for j in range(cached)])
            write_prefix(backend, full_k[-1][:cached], full_v[-1][:cached], k_cache, v_cache, pre)
        released = max(0, cached - window + 1) // block_size if window else 0
        for i in range(released):
            k_cache[table[i]], v_cache[table[i]] = (1e4, 1e4) if kv is None else (255, 255)
            table[i] = -1
        tables.append(table)
    # Decodes first, shortest context first (the runner's order).
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i][1] != 1, sum(seqs[i])))
    qs, ks, vs, slots, lens, starts = [], [], [], [], [], [0]
    for i in order:
        cached, new = seqs[i]
        n = cached + new
        qs.append(torch.randn(new, H, head_dim, generator=g).to(dtype))
        ks.append(full_k[i][cached:])
        vs.append(full_v[i][cached:])
        slots += [tables[i][j // block_size] * block_size + j % block_size for j in range(cached, n)]
        lens.append(n)
        starts.append(starts[-1] + new)
    layout = StepLayout(slots, [tables[i] for i in order], lens, starts, sum(1 for i in order if seqs[i][1] == 1))
    q = torch.cat(qs)
    kw = {"window": window} if window else {}
    out = backend.forward(q, torch.cat(ks), torch.cat(vs), k_cache, v_cache, backend.build_metadata(layout, "cpu"),
                          head_dim ** -0.5, **kw)
    row = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, qi in zip(order, qs):
        k, v = full_k[i].float(), full_v[i].float()
        if kv is not None:  # what the pool holds
            k, v = dequantize(quantize(k, kv, key=True), kv, key=True), dequantize(quantize(v, kv), kv)
        want = reference(qi.float(), k, v, head_dim ** -0.5, window)
        torch.testing.assert_close(out[row:row + len(qi)].float(), want, atol=tol, rtol=tol)
        row += len(qi)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [None, 2])
def test_paged_equals_contiguous(block_size, dtype, group):
    backend = get_backend("torch")
    backend.decode_group = group or len(SEQS)  # None: all decodes in one group
    run_paged(backend, block_size, dtype)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 6, 32, 200])
def test_sliding_window_reads_only_its_keys(window_backend, block_size, window):
    """A windowed layer: each query sees its last W keys; released (-1) entries below the
    window of a sequence's first query are never read. A window wider than every context
    is full attention."""
    backend = get_backend(window_backend)
    if window_backend == "torch":
        backend.decode_group = 2  # groups of mixed contexts: rows whose windows start in different blocks
    seqs = SEQS + [(100, 1), (37, 1), (70, 30)]
    run_paged(backend, block_size, torch.float32, window, seqs, seed=window)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2", "int4"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_backend_on_quantized_pools(kind, block_size):
    """--kv-cache-dtype on the torch backend: each new token quantized into its slot,
    blocks dequantized when read. Decodes and prefills over cached prefixes, GQA, in fp32
    and bf16, full and windowed: attention over the values the pool holds, exactly (the
    dequantized values are the reference's own); stale and released bytes never leak in."""
    backend = get_backend("torch")
    backend.decode_group = 2  # groups of mixed contexts: padding past a row's context is stale bytes
    backend.use_kv_dtype(KV_DTYPES[kind])
    dtype = torch.float32 if block_size == 1 else torch.bfloat16
    run_paged(backend, block_size, dtype, head_dim=32)  # int4's keys: a scale and a min per 32 dims
    run_paged(backend, block_size, dtype, window=6, seqs=SEQS + [(100, 1), (70, 30)], seed=1, head_dim=32)
