"""The state layers' per-token kernels (kernels/csrc/state_mixers.cpp) against the torch forms
they replace: the causal convolution over a step's chunks (each row's inputs from the step's rows,
its sequence's stored state, or zero; then the states the step leaves written to the pool), with
and without bias and SiLU, into float32 or the pool's dtype, reading a strided view in place; and
both gated RMS norms (Mamba-2's gate first, Qwen3-Next's gate after)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.kernels import load_ops
from pagedllm.models.gated_deltanet import OutputGatedNorm
from pagedllm.models.mamba2 import GatedRMSNorm
from pagedllm.models.short_conv import causal_conv

from .test_mamba_scan import step_of

D, K = 48, 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias, silu, out", [(True, True, torch.float32), (False, False, None), (True, False, None)])
def test_the_convolution_kernel_equals_the_torch_form(dtype, bias, silu, out):
    # fresh over blocks, from a state mid-block, a decode, one starting a block: every kind of tap;
    # (15, 17) writes its read block (block 0, at position 15) before a state that still reads it
    # (block 1's, at 16, holds position 14): the kernel reads the pool in place
    _, _, t, meta = step_of([(0, 40), (21, 30), (9, 10), (16, 17), (15, 17)])
    torch.manual_seed(5)
    conv = nn.Conv1d(D, D, K, groups=D, bias=bias).to(dtype)
    pool = (torch.randn(400, 2 * (K - 1) * D) * 0.5).to(dtype)   # a block holds a state and more
    wide = torch.randn(t, D + 7).to(dtype)                        # rows of another stride: a split view
    u = wide[:, 3:3 + D]
    theirs = pool.clone()
    with torch.no_grad():
        got = causal_conv(u, conv, pool, meta, load_ops(), silu=silu, out_dtype=out)
        want = causal_conv(u, conv, theirs, meta, None, silu=silu, out_dtype=out)
    assert got.dtype == want.dtype == (out or dtype)
    tol = 1e-5 if dtype == torch.float32 and (out or dtype) == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(pool, theirs), "the states the step leaves differ"
    assert len(meta.write_blocks) > 0


@pytest.mark.parametrize("gate_first", [True, False])
def test_both_gated_norms_equal_their_modules(gate_first):
    torch.manual_seed(6)
    t, heads, n = 7, 3, 32
    norm = GatedRMSNorm(heads * n, 1e-5) if gate_first else OutputGatedNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    y = torch.randn(t, heads * n)
    z = torch.randn(t, heads * n + 5)[:, 2:2 + heads * n]   # the gate: a split view
    out = torch.empty(t, heads * n)
    load_ops().gated_rms_norm(out, y, z, norm.weight.detach(), norm.eps, gate_first)
    with torch.no_grad():
        want = norm(y, z) if gate_first else norm(y.view(t, heads, n), z.reshape(t, heads, n)).view(t, -1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_norm_by_groups_of_channels_equals_its_module(dtype):
    """Nemotron-H's: each group of channels normed alone, a weight a channel (not one a group's
    value, as Qwen3-Next's heads share)."""
    torch.manual_seed(7)
    t, groups, n = 5, 4, 32
    norm = GatedRMSNorm(groups * n, 1e-5, groups)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    y = torch.randn(t, groups * n) * torch.linspace(0.1, 10, groups).repeat_interleave(n)   # groups far apart
    z = torch.randn(t, groups * n + 3)[:, 1:1 + groups * n].to(dtype)
    out = torch.empty(t, groups * n, dtype=dtype)
    load_ops().gated_rms_norm(out, y, z, norm.weight.detach().to(dtype), norm.eps, True, n)
    with torch.no_grad():
        want = norm.to(dtype)(y, z)
        whole = GatedRMSNorm(groups * n, 1e-5).to(dtype)
        whole.weight.copy_(norm.weight)
        assert not torch.allclose(whole(y, z).float(), want.float(), atol=0.1), "the groups must matter here"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
