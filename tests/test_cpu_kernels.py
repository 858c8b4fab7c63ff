"""The compiled CPU kernels against the torch reference: paged attention (its own block
layout) equals the reference backend on the same logical KV, and the fused norm / SiLU /
RoPE ops equal the torch expressions they replace."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.attention import StepLayout, get_backend
from pagedllm.kernels import load_ops


def build_step(seqs, heads, block_size, dtype, g, pad_rows_to=0):
    """KV pools for both backends holding each sequence's cached prefix, and the step's
    inputs: seqs = [(cached, new)], decodes ordered first as the runner does."""
    h, kvh, d = heads
    ref, cpu = get_backend("torch"), get_backend("cpu")
    ref.decode_group = 4  # several decode groups in one step
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    # Stale data everywhere: a kernel reading outside its blocks or slots would show.
    ref_k = torch.randn(ref.cache_shapes(num_blocks, block_size, kvh, d, dtype)[0], generator=g).to(dtype)
    ref_v = torch.randn(ref.cache_shapes(num_blocks, block_size, kvh, d, dtype)[1], generator=g).to(dtype)
    cpu_k = torch.randn(cpu.cache_shapes(num_blocks, block_size, kvh, d, dtype)[0], generator=g).to(dtype)
    cpu_v = torch.randn(cpu.cache_shapes(num_blocks, block_size, kvh, d, dtype)[1], generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i][1] != 1, sum(seqs[i])))
    qs, ks, vs, slots, tables, lens, starts = [], [], [], [], [], [], [0]
    for i in order:
        cached, new = seqs[i]
        n = cached + new
        table = [free.pop() for _ in range(-(-n // block_size))]
        k_all = torch.randn(n, kvh, d, generator=g).to(dtype)
        v_all = torch.randn(n, kvh, d, generator=g).to(dtype)
        if cached:  # the prefix's KV is already in both pools, written by each backend's own writer
            pre = [table[j // block_size] * block_size + j % block_size for j in range(cached)]
            from pagedllm.attention.torch_ref import write_kv
            write_kv(k_all[:cached], v_all[:cached], ref_k, ref_v, torch.tensor(pre))
            load_ops().write_kv(k_all[:cached], v_all[:cached], cpu_k, cpu_v, torch.tensor(pre))
        qs.append(torch.randn(new, h, d, generator=g).to(dtype))
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        slots += [table[j // block_size] * block_size + j % block_size for j in range(cached, n)]
        tables.append(table)
        lens.append(n)
        starts.append(starts[-1] + new)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    pad = pad_rows_to - len(q) if pad_rows_to else 0
    nd = sum(1 for i in order if seqs[i][1] == 1)
    layout = StepLayout(slots + [-1] * pad, tables, lens, starts, nd)
    return (ref, ref_k, ref_v), (cpu, cpu_k, cpu_v), q, k, v, layout, pad


def attend(backend, q, k, v, k_cache, v_cache, layout: StepLayout, scale: float):
    """The backend's attention over the step, through its own metadata."""
    return backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout, "cpu"), scale)


# (cached prefix, new tokens): decodes (one at context 1), a fresh prefill, a chunk over
# a cached prefix, a chunk longer than a query tile, a long decode.
SEQS = [(40, 1), (7, 1), (0, 1), (300, 1), (0, 23), (33, 9), (64, 64), (5, 2), (17, 70)]


AVX2_CHECK = """
import torch, sys
sys.path.insert(0, {tests!r})
from unit.test_cpu_kernels import SEQS, attend, build_step
from pagedllm.kernels import load_ops
ops = load_ops()
for dtype in (torch.float32, torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    (ref, rk, rv), (cpu, ck, cv), q, k, v, layout, _ = build_step(SEQS, (9, 3, 64), 16, dtype, g)
    torch.testing.assert_close(attend(cpu, q, k, v, ck, cv, layout, 0.125).float(),
                               attend(ref, q, k, v, rk, rv, layout, 0.125).float(), atol=2e-2, rtol=2e-2)
    x = torch.randn(5, 576).to(dtype); w = torch.ones(576).to(dtype); out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out.float(), torch.nn.functional.rms_norm(x.float(), (576,), eps=1e-5), atol=2e-2, rtol=2e-2)
    logits = torch.randn(3, 1000).to(dtype); want = torch.tensor([1, 2, 999])
    lp, rank, ids, vals = ops.score_rows(logits, want, 5)
    ref = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(lp, ref.gather(1, want[:, None])[:, 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(vals, torch.topk(ref, 5).values, atol=1e-4, rtol=0)
print("ok")
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the AVX2 build is an x86 check")
def test_avx2_build_without_avx512(avx2_kernel_cache):
    """Laptops without AVX-512 get the generic vector code: build that copy (-march=x86-64-v3)
    in a separate cache (on a CPU without AVX-512: the native build) and check it against the
    reference in its own process."""
    env = {**os.environ, **avx2_kernel_cache}
    r = subprocess.run([sys.executable, "-c", AVX2_CHECK.format(tests=os.path.dirname(__file__))], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    if avx2_kernel_cache:
        from pathlib import Path
        assert list(Path(avx2_kernel_cache["PAGEDLLM_CACHE"]).glob("ext/*/*.so")), \
            "the AVX2 copy was not built in its own cache"
