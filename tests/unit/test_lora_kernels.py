"""lora_sgmv (kernels/csrc/lora.cpp), the step's low-rank passes over their rows in one call a
matmul, against torch: segments of several adapters, one without this matmul (R = 0), row counts
that leave a short group of 4, K and N with tails past 16; and the torch path of LoRAStep (no
kernels) against the compiled one."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_ops
from pagedllm.lora.adapter import LoRAAdapter, LoRAModule
from pagedllm.lora.batch import lora_step
from pagedllm.lora.request import LoRARequest


def reference(out, x, rows, starts, a, bt):
    want = out.float().clone()
    for s in range(len(a)):
        idx = rows[starts[s]:starts[s + 1]]
        if a[s].shape[0]:
            want[idx] += (x[idx].float() @ a[s].float().T) @ bt[s].float()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 96), (72, 40)])
def test_sgmv_is_the_segments_low_rank_passes(dtype, k, n):
    g = torch.Generator().manual_seed(0)
    t = 23
    x, out = torch.randn(t, k, generator=g).to(dtype), torch.randn(t, n, generator=g).to(dtype)
    ranks = [8, 0, 24, 4]   # the second adapter has no pieces on this matmul
    a = [torch.randn(r, k, generator=g).to(dtype) / 4 for r in ranks]
    bt = [torch.randn(r, n, generator=g).to(dtype) / 4 for r in ranks]
    rows = torch.randperm(t, generator=g)[:18]   # 5 rows on the base model: untouched
    starts = torch.tensor([0, 7, 9, 14, 18])
    want = reference(out, x, rows, starts, a, bt)
    got = out.clone()
    load_ops().lora_sgmv(got, x, rows, starts, a, bt)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    base = torch.ones(t, dtype=torch.bool)
    base[rows] = False
    assert torch.equal(got[base], out[base])


def test_sgmv_refuses_bad_rows_and_pairs():
    x, out = torch.randn(4, 32), torch.zeros(4, 16)
    a, bt = [torch.randn(2, 32)], [torch.randn(2, 16)]
    with pytest.raises(RuntimeError, match="row 4 is outside x's 4"):
        load_ops().lora_sgmv(out, x, torch.tensor([0, 4]), torch.tensor([0, 2]), a, bt)
    with pytest.raises(RuntimeError, match="seg_starts must rise from 0 to len"):
        load_ops().lora_sgmv(out, x, torch.tensor([0, 1]), torch.tensor([0, 1]), a, bt)
    with pytest.raises(RuntimeError, match="pair 0 must be A"):
        load_ops().lora_sgmv(out, x, torch.tensor([0]), torch.tensor([0, 1]), [torch.randn(2, 31)], bt)


def test_step_on_torch_equals_the_kernel():
    g = torch.Generator().manual_seed(1)
    k, n, t = 48, 80, 11

    def adapter(i: int, r: int) -> LoRAAdapter:
        mod = LoRAModule(torch.randn(r, k, generator=g), torch.randn(r, n, generator=g))
        return LoRAAdapter(LoRARequest(f"a{i}", i, "/none"), r, {"layers.0.mlp.down_proj": mod})

    adapters = {1: adapter(1, 4), 2: adapter(2, 8)}
    x, base = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
    for rows in ({1: [0, 3, 4], 2: [7, 1]}, {2: list(range(t))}):
        outs = []
        for kernels in (None, load_ops()):
            step = lora_step(rows, adapters, t, torch.device("cpu"), kernels)
            outs.append(step.add("layers.0.mlp.down_proj", x, base.clone()))
            assert step.add("layers.0.self_attn.o_proj", x, base.clone()).equal(base)   # no pieces there
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
        assert not outs[0].equal(base)
