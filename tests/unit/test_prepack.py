"""Weights reordered once for oneDNN (models/prepack.py): the same products as F.linear, one
copy of each weight kept, quantized and shared weights left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.prepack import (
    can_prepack,
    packed_linear,
    prepack_linears,
    prepack_wanted,
)


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    m = nn.ModuleDict({"a": nn.Linear(64, 96, bias=False), "b": nn.Linear(96, 32, bias=True),
                       "q": nn.Linear(64, 64, bias=False), "emb": nn.Embedding(10, 64)})
    m.q.qformat = "q8_0"  # what quantization.py marks a quantized layer with
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 96])
def test_packed_products_match_f_linear(dtype, rows):
    m = _model(dtype)
    if not can_prepack(torch.empty(2, 2, dtype=dtype)):  # (bf16 on CPUs without AVX-512: oneDNN has no kernel)
        assert prepack_linears(m, keep=set()) == 0 and m.a.weight is not None and not hasattr(m.a, "packed")
        return
    plain = {k: (m[k].weight.detach().clone(), m[k].bias) for k in ("a", "b")}
    assert prepack_linears(m, keep=set()) == 2
    x = torch.randn(rows, 64).to(dtype)
    with torch.inference_mode():
        want = F.linear(F.linear(x, plain["a"][0]), plain["b"][0], plain["b"][1])
        got = packed_linear(m.b, packed_linear(m.a, x))
    # bf16: the same kernels on the same values, bit for bit; fp32: sums may split differently
    tol = 0 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_one_copy_kept_unless_shared_and_quantized_left_alone():
    m = _model(torch.float32)
    m.a.weight = nn.Parameter(torch.randn(96, 64))
    shared = m.a.weight
    q_weight = m.q.weight
    assert prepack_linears(m, keep={id(shared)}) == 2
    assert m.a.weight is shared and hasattr(m.a, "packed")      # shared (a tied embedding): kept beside
    assert m.b.weight is None and hasattr(m.b, "packed")        # the packed copy is the only one
    assert m.q.weight is q_weight and not hasattr(m.q, "packed")  # quantized: its own kernels read it


def test_prepack_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_PREPACK", raising=False)
    assert prepack_wanted()
    monkeypatch.setenv("PAGEDLLM_PREPACK", "0")
    assert not prepack_wanted()
