"""Weights reordered once for oneDNN (models/prepack.py): the same products as F.linear, one
copy of each weight kept, quantized and shared weights left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
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


# --- bf16 weights in panels for our kernel (kernels/csrc/bf16_panels.h) ---------------------------

def test_panels_round_trip_any_width():
    from pagedllm.models.prepack import from_panels, to_panels

    for n in (1, 31, 32, 33, 100):
        w = torch.randn(n, 6)
        p = to_panels(w)
        assert p.shape == (-(-n // 32), 3, 32, 2)
        assert torch.equal(from_panels(p, n), w)
        assert torch.equal(p[0, 1, 0], w[0, 2:4])  # column 0's second pair of k
    e = torch.randn(3, 64, 8)   # a mixture's experts: each its own panels
    assert torch.equal(from_panels(to_panels(e)[1], 64), e[1])


@pytest.fixture
def panel_kernels(monkeypatch):
    """The CPU kernels with the panels forced wherever a weight can take them (the chooser would
    pick by timing, which these tests of the panels' arithmetic must not hang on)."""
    from pagedllm.kernels import load_ops
    from pagedllm.models.prepack import panels_wanted

    monkeypatch.setenv("PAGEDLLM_PREPACK", "panels")
    k = load_ops()
    assert panels_wanted(k), "the CPU has AVX512-BF16 but the kernels were built without the panels"
    return k


@pytest.mark.needs_cpu("avx512_bf16")
@pytest.mark.parametrize("rows", [0, 1, 13, 14, 15, 300])
def test_panel_products_match_fp32(rows, panel_kernels):
    """bf16 products summed in fp32 and rounded once: within bf16's rounding of the fp32 result,
    for widths that fill no whole panel, a bias, rows past a 256-row sweep, and strided rows."""
    kernels = panel_kernels
    m = _model(torch.bfloat16)
    m.c = nn.Linear(64, 45, bias=True).to(torch.bfloat16)   # 45 columns: a panel and a part
    plain = {k: (m[k].weight.detach().clone(), m[k].bias) for k in ("a", "b", "c")}
    assert prepack_linears(m, keep=set(), kernels=kernels) == 3
    assert m.a.weight is None and hasattr(m.a, "panels") and not hasattr(m.a, "packed")
    wide = torch.randn(rows, 80).to(torch.bfloat16)
    x = wide[:, 8:72]   # rows 80 apart
    with torch.inference_mode():
        for name, y in (("a", packed_linear(m.a, x, kernels)), ("c", packed_linear(m.c, x, kernels))):
            w, b = plain[name]
            want = x.float() @ w.float().t() + (b.float() if b is not None else 0)
            torch.testing.assert_close(y.float(), want.bfloat16().float(), atol=1e-2, rtol=2 ** -7)
        y = packed_linear(m.b, packed_linear(m.a, x, kernels), kernels)
        assert y.shape == (rows, 32)


@pytest.mark.needs_cpu("avx512_bf16")
@pytest.mark.parametrize("k", [576, 2048, 2050])
def test_panel_rows_independent_of_the_batch(k, panel_kernels):
    """Alone (read in place) or among 40 (rows 4 KB apart, K = 2048, are packed first): the same
    bits, and near fp32; an odd row stride (2050 elements of 2052) read in place."""
    kernels = panel_kernels
    layer = nn.Linear(k, 100, bias=False).to(torch.bfloat16)
    w = layer.weight.detach().float()
    prepack_linears(layer, keep=set(), kernels=kernels)
    x = torch.randn(40, k + 2).to(torch.bfloat16)[:, 1:k + 1] if k % 4 else torch.randn(40, k).to(torch.bfloat16)
    alone = torch.cat([packed_linear(layer, x[i:i + 1], kernels) for i in range(40)])
    assert torch.equal(packed_linear(layer, x, kernels), alone)
    torch.testing.assert_close(alone.float(), (x.float() @ w.t()).bfloat16().float(), atol=2e-2, rtol=2 ** -7)


def _argmax_of_products(kernels, x: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:
    out = x.new_empty(x.shape[0], n)
    kernels.panel_linear(out, x, p, None)
    return out.float().max(dim=-1).indices   # torch's rule: the first largest, a NaN the largest


@pytest.mark.needs_cpu("avx512_bf16")
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 100), k=st.sampled_from([2, 64, 578]),
       kind=st.sampled_from(["normal", "ties", "nan", "-inf"]), seed=st.integers(0, 2 ** 31 - 1))
def test_panel_argmax_is_the_argmax_of_the_products(m, n, k, kind, seed):
    """The greedy head (panel_argmax) picks what argmax over panel_linear's bf16 output picks:
    the first of equal values (small integers make many), a NaN column first, index 0 for a row of
    -inf only, widths that fill no whole panel."""
    from pagedllm.kernels import load_ops
    from pagedllm.models.prepack import to_panels

    kernels = load_ops()
    assert kernels.has_panel_linear(), "the CPU has AVX512-BF16 but the kernels were built without the panels"
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        w = torch.randint(-2, 3, (n, k), generator=g).float()
        x = torch.randint(-2, 3, (m, k), generator=g).float()
    else:
        w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    if kind == "nan":
        w[torch.randint(0, n, (2,), generator=g)] = float("nan")
    if kind == "-inf":
        w, x = torch.full((n, k), float("-inf")), x.abs() + 1
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    p = to_panels(w)
    assert torch.equal(kernels.panel_argmax(x, p, n), _argmax_of_products(kernels, x, p, n))


@pytest.mark.needs_cpu("avx512_bf16")
@pytest.mark.parametrize("m,k", [(300, 64), (40, 2048)])
def test_panel_argmax_past_a_sweep_and_on_packed_rows(m, k, panel_kernels):
    """Rows past one 256-row sweep; rows 4 KB apart (K = 2048), which the kernel packs first;
    and the LM head's layer-level call (packed_argmax) on a strided view."""
    from pagedllm.models.prepack import argmax_ready, packed_argmax

    kernels = panel_kernels
    head = nn.Linear(k, 1000, bias=False).to(torch.bfloat16)
    prepack_linears(head, keep=set(), kernels=kernels, head=head)
    assert argmax_ready(head, kernels)
    x = torch.randn(m, k + 2).to(torch.bfloat16)[:, 1:k + 1]
    want = _argmax_of_products(kernels, x.contiguous(), head.panels, 1000)
    assert torch.equal(packed_argmax(head, x, kernels), want)
    biased = nn.Linear(k, 10, bias=True).to(torch.bfloat16)
    prepack_linears(biased, keep=set(), kernels=kernels, head=biased)
    assert not argmax_ready(biased, kernels)   # the kernel adds no bias: such a head keeps its logits


def test_onednn_layout_can_be_asked_for(monkeypatch):
    from pagedllm.kernels import load_ops
    from pagedllm.models.prepack import panels_wanted

    monkeypatch.setenv("PAGEDLLM_PREPACK", "onednn")
    assert prepack_wanted() and not panels_wanted(load_ops())
    assert not panels_wanted(None)
