"""The AVX2 copy of the compiled CPU kernels, built in its own cache and checked in its own
process against the torch reference (the checks themselves: tests/unit/test_cpu_kernels.py; the
q8_0 block matmul's against the dequantized product)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
    # q8_0 blocks: a tile in registers (3 rows) and, without AVX-512, W unpacked a group at a time for sgemm (40)
    qs = torch.randint(-127, 128, (37, 18, 32), generator=g, dtype=torch.int8)
    qd = (torch.rand(37, 18, generator=g) * 0.02 + 1e-3).half()
    w = (qs.float() * qd.float()[..., None]).reshape(37, 576)
    for m in (1, 3, 40):
        x = torch.randn(m, 576, generator=g).to(dtype); out = torch.empty(m, 37, dtype=dtype)
        ops.q8_0_linear(out, x, qs, qd)
        want = x.float() @ w.T
        torch.testing.assert_close(out.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
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
