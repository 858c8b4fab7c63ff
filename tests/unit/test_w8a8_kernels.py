"""W8A8 (`quantization="w8a8"`): the kernels' passes against their torch expressions, the
int8 matmul against the float product of what it quantized, a row's result alone and in
any batch bit for bit, SmoothQuant's folding leaving the float model's output unchanged,
perplexity and greedy agreement against bf16 with floors, and W8A8 under tensor parallel,
speculation and batch-invariant mode."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pagedllm import LLM
from pagedllm.kernels import load_ops
from pagedllm.models.w8a8 import (
    can_pack_w8a8,
    embed_rows,
    pack_w8a8,
    quantize_rows,
    quantize_weight,
    set_w8a8,
    w8a8_linear,
)

# oneDNN's reordered int8 path: where the CPU has int8 dot products (can_pack_w8a8)
needs_packing = pytest.mark.needs_cpu("avx512_vnni", "avx_vnni", "amx_int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_quantization_kernel_is_the_torch_expression(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=g) * torch.logspace(-3, 2, 7)[:, None]).to(dtype)
    x[3] = 0  # a row of zeros: scale 0, codes 0
    x[5, 17] = 300.0  # an outlier sets its row's scale
    q, s = quantize_rows(x, load_ops())
    q_ref, s_ref = quantize_rows(x, None)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    for kernels in (load_ops(), None):  # the reordered path's uint8 codes: the same plus 128
        u, su = quantize_rows(x, kernels, offset=True)
        assert u.dtype == torch.uint8 and torch.equal(u.int() - 128, q.int()) and torch.equal(su, s)
    assert s[3] == 0 and not q[3].any() and q.abs().max() == 127
    assert ((q.float() * s[:, None] - x.float()).abs() <= s[:, None] / 2 + 1e-6).all()  # round to nearest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_linear_is_the_float_product_of_its_int8_operands(dtype, bias):
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(160, 48, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 160, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(48, generator=g))
    layer = layer.to(dtype)
    w = layer.weight.detach().clone()
    set_w8a8(layer, dtype)
    assert layer.weight is None and layer.wq.dtype == torch.int8 and layer.wq.shape == (48, 160)
    wq, ws = quantize_weight(w)
    assert torch.equal(layer.wq, wq) and torch.equal(layer.ws, ws)
    for m in (1, 5, 40):
        x = torch.randn(m, 160, generator=g).to(dtype)
        xq, sx = quantize_rows(x, None)
        want = (xq.float() * sx[:, None]) @ (wq.float() * ws[:, None]).T
        if bias:
            want = want + layer.bias.float()
        tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        for kernels in (load_ops(), None):
            torch.testing.assert_close(w8a8_linear(layer, x, kernels).float(), want, **tol)
        # and the product is close to the float layer's (int8 of both operands: ~1 % here)
        ref = x.float() @ w.float().T + (layer.bias.float() if bias else 0)
        assert (w8a8_linear(layer, x, load_ops()).float() - ref).norm() / ref.norm() < 0.02
    rows = embed_rows(layer, torch.tensor([[3, 0]]))
    torch.testing.assert_close(rows.float()[0], (wq.float() * ws[:, None])[[3, 0]].to(dtype).float())


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [256, 5632])
def test_reordered_int8_weights_sum_the_plain_paths_integers(dtype, bias, k):
    """oneDNN's kernels on the reordered weight (uint8 activations, zero point 128) sum the same
    integers as torch._int_mm on the plain one, and hand them back as float32. How they take the
    zero point back out is the kernel's: oneDNN's AMX path does it in float32 from 17 rows on, so
    a sum is exact wherever its uint8 partial sums stay below 2^24 (at K = 256: 255 x 127 x 256 <
    2^24, bit for bit on every CPU), and within a few float32 roundings of their bound past that
    (K = 5632, and every product 127 x 127 in the first row and columns); the layer's output then
    within that plus one rounding to its dtype."""
    from pagedllm.models.w8a8 import int_matmul, packed_int_matmul

    g = torch.Generator().manual_seed(3)
    layer = nn.Linear(k, 80, bias=bias).to(dtype)
    set_w8a8(layer, dtype)
    layer.wq[0], layer.wq[1] = 127, -127
    plain = copy.deepcopy(layer)
    pack_w8a8(layer)
    assert layer.wq is None and layer.wq_packed is not None
    bound = 255 * plain.wq.abs().sum(dim=1).double()                    # of any uint8 partial sum, per column
    acc_tol = 4 * 2.0 ** (torch.ceil(torch.log2(bound)) - 24).clamp(min=-30)
    exact = bool((bound < 2 ** 24).all())
    assert exact == (k == 256)
    for m in (1, 3, 17, 64):
        x = torch.randn(m, k, generator=g).to(dtype)
        x[0] = 1.0  # every code 127
        xq, sx = quantize_rows(x, None)
        xu, _ = quantize_rows(x, None, offset=True)
        sums, packed_sums = int_matmul(xq, plain.wq), packed_int_matmul(xu, layer)
        assert ((packed_sums.double() - sums.double()).abs() <= (0 if exact else acc_tol)).all(), m
        for kernels in (load_ops(), None):
            got, want = w8a8_linear(layer, x, kernels), w8a8_linear(plain, x, kernels)
            if exact:
                assert torch.equal(got, want), (m, kernels)
                continue
            rounding = (2 ** -8 if dtype == torch.bfloat16 else 2 ** -23) * want.double().abs()
            tol = sx.double()[:, None] * plain.ws.double()[None, :] * acc_tol[None, :] + rounding
            assert ((got.double() - want.double()).abs() <= tol).all(), (m, kernels)


@needs_packing
def test_a_packed_tied_head_keeps_its_rows_for_the_embedding():
    layer = nn.Linear(64, 32, bias=False)
    set_w8a8(layer, torch.float32)
    want = embed_rows(layer, torch.tensor([5, 1]))
    pack_w8a8(layer, keep_plain=True)
    assert torch.equal(embed_rows(layer, torch.tensor([5, 1])), want)


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_packing)])
def test_a_rows_result_is_the_same_alone_and_in_any_batch(packed):
    """Per-token scales and exact int32 sums: what batch-invariant mode needs, bit for bit."""
    assert not packed or can_pack_w8a8()
    g = torch.Generator().manual_seed(2)
    layer = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    set_w8a8(layer, torch.bfloat16)
    if packed:
        pack_w8a8(layer)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    ops = load_ops()
    full = w8a8_linear(layer, x, ops)
    for rows in ([7], [0, 7, 9], list(range(40)), list(range(63, 20, -1))):
        assert torch.equal(w8a8_linear(layer, x[rows], ops), full[rows]), rows


def test_bad_combinations_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="batch_invariant does not run int8 blocks"):
        LLM(quantization="int8", batch_invariant=True)
    with pytest.raises(ValueError, match="quantization gguf with tensor_parallel_size > 1 is not supported"):
        LLM(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="w4a4")


@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (8, 1536, 1100), (5, 2049, 64), (3, 64, 2500)])
def test_float32_int_matmul_is_the_exact_integer_product(m, k, n):
    """The sgemm path of CPUs without int8 dot products: the same int32 sums as torch._int_mm,
    at the extremes too (rows where every product is 127 x 127 or -128 x -128), with K across
    several exact slices and N across row blocks."""
    from pagedllm.models.w8a8 import int_matmul_f32

    g = torch.Generator().manual_seed(m * k + n)
    xq = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    xq[0], wq[0] = 127, 127
    if m > 1:
        xq[1], wq[1] = -128, -128
    want = xq.long() @ wq.long().t()   # int64: no rounding at all
    assert torch.equal(int_matmul_f32(xq, wq).long(), want)
