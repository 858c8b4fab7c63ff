"""Weight-only quantization on llama.cpp blocks (`quantization="gguf" | "int8" | "int4"`): the
block kernels against the dequantized matmul, the GGUF file's blocks against its bf16
conversion, greedy output against bf16's, and bad settings refused."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest



AVX2_CHECK = """
import torch
from pagedllm.kernels import load_ops
from pagedllm.models.quantization import Blocks, Q4_1, Q8_0
ops = load_ops()
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for m in (1, 6):
        x = torch.randn(m, 96, generator=g).to(dtype)
        d = (torch.rand(5, 4, generator=g) * 0.02).half()
        qs = torch.randint(0, 256, (5, 2, 32), generator=g, dtype=torch.uint8)
        q = torch.stack([qs & 15, qs >> 4], 2).reshape(5, 4, 32)[:, :3]
        mm = (-torch.rand(5, 4, generator=g) * 0.1).half()
        w = Blocks(Q4_1, q, d[:, :3], mm[:, :3]).dequantize()
        out = torch.empty(m, 5, dtype=dtype)
        ops.q4_1_linear(out, x, qs, d, mm)
        torch.testing.assert_close(out.float(), x.float() @ w.T, atol=3e-2, rtol=2e-2)
        q8 = torch.randint(-127, 128, (5, 3, 32), generator=g, dtype=torch.int8)
        ops.q8_0_linear(out, x, q8, d[:, :3].contiguous())
        w8 = Blocks(Q8_0, q8, d[:, :3]).dequantize()
        torch.testing.assert_close(out.float(), x.float() @ w8.T, atol=3e-2, rtol=2e-2)
print("ok")
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the AVX2 build is an x86 check")
def test_block_kernels_without_avx512(avx2_kernel_cache):
    """CPUs without AVX-512 (BF16) run the generic vector code: build that copy
    (-march=x86-64-v3) in its own cache and check it in its own process."""
    env = {**os.environ, **avx2_kernel_cache}
    r = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
