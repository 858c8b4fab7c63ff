"""Weight-only quantization on llama.cpp blocks (`quantization="gguf" | "int8" | "int4"`): the
block kernels against the dequantized matmul (GGUF's Q5 and K-quant types against gguf-py's reader), the GGUF file's blocks against its bf16
conversion, greedy output against bf16's, and bad settings refused."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from pagedllm import LLM
from pagedllm.kernels import load_ops
from pagedllm.models.quantization import (Q4_1, Q8_0, RAW_TYPES, Blocks, RawBlocks, block_linear, cat_rows,
                                          dequantize, embed_rows, layer_blocks, quantize_q4_1, quantize_q8_0,
                                          set_blocks)


def random_blocks(fmt: str, n: int, k: int, g: torch.Generator) -> Blocks:
    nblk = k // 32
    d = (torch.rand(n, nblk, generator=g) * 0.02 + 1e-3).half()
    if fmt == Q4_1:
        q = torch.randint(0, 16, (n, nblk, 32), generator=g, dtype=torch.uint8)
        return Blocks(Q4_1, q, d, (-torch.rand(n, nblk, generator=g) * 0.1).half())
    return Blocks(Q8_0, torch.randint(-127, 128, (n, nblk, 32), generator=g, dtype=torch.int8), d)


def layer_with(blocks: Blocks, dtype: torch.dtype, bias: bool = False) -> nn.Linear:
    n, k = blocks.shape
    layer = nn.Linear(k, n, bias=bias).to(dtype)
    set_blocks(layer, blocks, dtype)
    return layer


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [96, 576])  # 3 blocks: q4_1 pairs with an empty block
def test_block_kernels_are_the_dequantized_matmul(fmt, dtype, k):
    g = torch.Generator().manual_seed(0)
    blocks = random_blocks(fmt, 37, k, g)  # 37: columns past the last group of 4
    layer = layer_with(blocks, dtype)
    assert layer.weight is None
    w = blocks.dequantize()
    ops = load_ops()
    # a tile in registers (1-6 rows; q4_1 x bf16 up to 4 on its own path), the scratch path
    # with a short last tile, many tiles, chunks of rows (K=576: 222 rows of bf16 a chunk), and
    # bf16 rows from 64 on: panels of 32 columns unpacked for the bf16 panels' tiles. Without
    # AVX-512, fp32 rows up to 16 take a row of W at a time, 8 rows of x at a time (9: 8 and 1)
    for m in (1, 3, 5, 9, 16, 40, 64, 500):
        x = torch.randn(m, k, generator=g).to(dtype)
        want = x.float() @ w.T
        tol = dict(atol=1e-4 * want.abs().max().item(), rtol=1e-4) if dtype == torch.float32 else \
            dict(atol=1e-2 * want.abs().max().item(), rtol=1e-2)
        out = torch.empty(m, 37, dtype=dtype)
        if fmt == Q4_1:
            ops.q4_1_linear(out, x, layer.qs, layer.qd, layer.qm)
        else:
            ops.q8_0_linear(out, x, layer.qs, layer.qd)
        torch.testing.assert_close(out.float(), want, **tol)
        # the model's entry point: the kernel at any M; without kernels, dequantize + matmul
        torch.testing.assert_close(block_linear(layer, x, ops), out, atol=0, rtol=0)
        torch.testing.assert_close(block_linear(layer, x, None).float(), want, **tol)
    torch.testing.assert_close(dequantize(layer, dtype).float(), w, atol=0, rtol=2 ** -8)
    assert torch.equal(layer_blocks(layer).dequantize(), w)
    ids = torch.tensor([[3, 0], [36, 3]])
    torch.testing.assert_close(embed_rows(layer, ids).float(), w[ids].to(dtype).float(), atol=0, rtol=0)


def test_bias_and_bad_shapes():
    g = torch.Generator().manual_seed(1)
    layer = layer_with(random_blocks(Q4_1, 8, 64, g), torch.float32, bias=True)
    x = torch.randn(2, 64, generator=g)
    want = x @ layer_blocks(layer).dequantize().T + layer.bias
    torch.testing.assert_close(block_linear(layer, x, load_ops()), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        load_ops().q8_0_linear(torch.empty(2, 8), torch.randn(2, 40), torch.zeros(8, 1, 32, dtype=torch.int8),
                               torch.ones(8, 1, dtype=torch.half))
    with pytest.raises(ValueError, match="shape"):
        set_blocks(nn.Linear(64, 9), random_blocks(Q8_0, 8, 64, g), torch.float32)


@pytest.mark.parametrize("quantize,fmt", [(quantize_q4_1, Q4_1), (quantize_q8_0, Q8_0)])
def test_quantize_rounds_to_the_nearest_step(quantize, fmt):
    torch.manual_seed(0)
    w = torch.randn(24, 128)
    b = quantize(w)
    assert b.fmt == fmt
    err = (b.dequantize() - w).abs().reshape(24, 4, 32)
    assert (err <= b.d[..., None] * 0.5 + 1e-6).all()
    assert err.max() > 0  # it did quantize


def test_bad_quantization_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"quantization must be one of \('gguf', 'int8', 'int4', 'w8a8'\), got 'int3'"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="batch_invariant does not run int8 blocks"):
        LLM(quantization="int8", batch_invariant=True)
    with pytest.raises(ValueError, match="quantization gguf with tensor_parallel_size > 1"):
        LLM(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization 'gguf' runs a .gguf file's own blocks"):
        LLM(quantization="gguf", model=str(tmp_path))


def random_raw(fmt: str, n: int, k: int, g: torch.Generator) -> RawBlocks:
    """A [n, k] weight in GGUF type `fmt`: random bytes (every bit pattern of quants and scales is
    a valid block), with sane fp16 d (and dmin) where the type keeps them."""
    _, nbytes, weights = RAW_TYPES[fmt]
    raw = torch.randint(0, 256, (n, k // weights, nbytes), generator=g, dtype=torch.uint8)

    def fp16_at(offset: int, scale: float) -> None:
        v = (torch.rand(n, k // weights, generator=g) * scale + scale / 10).half()
        raw[..., offset:offset + 2] = v.view(torch.uint8).reshape(n, k // weights, 2)
    if fmt in ("Q5_0", "Q5_1"):
        fp16_at(0, 0.02)
        if fmt == "Q5_1":
            fp16_at(2, -0.1)
    elif fmt in ("Q4_K", "Q5_K"):
        fp16_at(0, 0.002)
        fp16_at(2, 0.002)
    elif fmt == "MXFP4":   # an E8M0 exponent first: weights up to 12 x 2^-6, as large as the others'
        raw[..., 0] = torch.randint(119, 123, (n, k // weights), generator=g, dtype=torch.uint8)
    else:  # Q6_K: d last
        fp16_at(208, 0.001)
    return RawBlocks(fmt, raw.reshape(n, -1))


@pytest.mark.parametrize("fmt", sorted(RAW_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_block_kernels_are_gguf_pys_dequantized_matmul(fmt, dtype):
    """Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 from the file's bytes (ggml_linear) equal gguf-py's own
    dequantization (the reference reader of the format) times x, at every path's M."""
    g = torch.Generator().manual_seed(1)
    k = 512  # two K-quant super-blocks, 16 blocks of 32
    blocks = random_raw(fmt, 37, k, g)
    w = blocks.dequantize()
    assert w.shape == (37, k) and torch.isfinite(w).all()
    layer = layer_with(blocks, dtype)
    assert layer.weight is None and layer.qraw.shape == (37, k // RAW_TYPES[fmt][2] * RAW_TYPES[fmt][1])
    ops = load_ops()
    # int8 codes (1, 4), blocks unpacked to registers (7) or 4 columns at a time (40), and from 64
    # rows whole panels of 32 columns (100: the second panel 5 columns, the last tile 2 rows);
    # without AVX-512, fp32 rows up to 16 a row of W at a time, 8 rows of x at a time (12: 8 and 4)
    for m in (1, 4, 7, 12, 40, 100):
        x = torch.randn(m, k, generator=g).to(dtype)
        want = x.float() @ w.T
        tol = dict(atol=1e-4 * want.abs().max().item(), rtol=1e-4) if dtype == torch.float32 else \
            dict(atol=1e-2 * want.abs().max().item(), rtol=1e-2)
        out = block_linear(layer, x, ops)
        torch.testing.assert_close(out.float(), want, **tol)
        torch.testing.assert_close(block_linear(layer, x, None).float(), want, **tol)
    assert torch.equal(layer_blocks(layer, torch.tensor([3, 0])).dequantize(), w[[3, 0]])  # a tied embedding's rows
    with pytest.raises(RuntimeError, match="raw must be contiguous uint8"):
        ops.ggml_linear(torch.empty(1, 37, dtype=dtype), torch.zeros(1, k + 256, dtype=dtype), layer.qraw,
                        RAW_TYPES[fmt][0])


def test_q5_0_fuses_with_q8_0_exactly():
    """Gemma's attn_v is Q8_0 where its q and k are Q5_0: the fused qkv runs as q8_0, the Q5_0
    parts converted without changing a weight."""
    g = torch.Generator().manual_seed(2)
    q5, q8 = random_raw("Q5_0", 8, 64, g), random_blocks(Q8_0, 4, 64, g)
    fused = cat_rows([q5, q5, q8])
    assert fused.fmt == Q8_0
    assert torch.equal(fused.dequantize(), torch.cat([q5.dequantize(), q5.dequantize(), q8.dequantize()]))
    with pytest.raises(ValueError, match="cannot fuse"):
        cat_rows([random_raw("Q4_K", 4, 256, g), random_raw("Q6_K", 4, 256, g)])


def vnni() -> bool:
    """Whether the kernels (built for this CPU) take up to 4 bf16 rows against blocks in int8
    arithmetic (AVX512_VNNI), as llama.cpp computes one request."""
    try:
        return "avx512_vnni" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def x_codes(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: each 32 values int8 codes of max |x| / 127, to nearest."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


@pytest.mark.parametrize("fmt", [Q8_0, *sorted(RAW_TYPES)])
def test_few_bf16_rows_are_int8_codes_times_the_blocks(fmt):
    """Up to 4 bf16 rows (one request's decode) on a VNNI CPU: x in int8 codes per 32 values
    times the blocks, to bf16's rounding of the result; the exact path elsewhere. Also K of an
    odd number of blocks (a half chunk of 64 at the end) and columns past a group of 4."""
    g = torch.Generator().manual_seed(3)
    ops = load_ops()
    off_codes = off_exact = 0.0
    for k in ((96, 512) if fmt in (Q8_0, "Q5_0", "Q5_1", "MXFP4") else (512,)):
        blocks = random_blocks(fmt, 37, k, g) if fmt == Q8_0 else random_raw(fmt, 37, k, g)
        layer, w = layer_with(blocks, torch.bfloat16), blocks.dequantize().double()
        for m in (1, 2, 4):
            x = torch.randn(m, k, generator=g).bfloat16()
            want = (x_codes(x) if vnni() else x.float()).double() @ w.T
            exact = x.double() @ w.T
            out = block_linear(layer, x, ops).double()
            scale = want.abs().max().item()
            # fp32 sums of per-block terms: ~1e-3 of the largest output past bf16 rounding, every format alike
            torch.testing.assert_close(out, want, atol=2e-3 * scale, rtol=2 ** -8)
            off_codes += (out - want).abs().mean().item()
            off_exact += (exact - want).abs().mean().item()
    if vnni():  # the codes are what was computed: it is closer to them than x itself is
        assert off_codes < 0.6 * off_exact, (off_codes, off_exact)


@pytest.mark.needs_cpu("avx512_vnni")   # the repacked MXFP4 kernel
def test_repacked_mxfp4_is_the_files_blocks_in_another_order():
    """mxfp4_interleave's bytes (16 rows' codes side by side, for the int8 outer-product kernel) give
    back the file's blocks exactly, and multiply as they do: fp32 x exactly, bf16 x through int8
    codes (as the 1-4 row path has always run); a bf16 row's result does not depend on the others."""
    from pagedllm.models.moe import MXFP4_IL, deinterleave_mxfp4

    assert load_ops().moe_can_w8a8(), "the CPU has AVX512-VNNI but the kernels were built without it"
    g = torch.Generator().manual_seed(2)
    n, k = 48, 96   # three groups of 16 rows, three blocks
    blocks = random_raw("MXFP4", n, k, g)
    raw, w = blocks.raw.contiguous(), blocks.dequantize()
    ops = load_ops()
    il = ops.mxfp4_interleave(raw)
    assert il.shape == raw.shape and not torch.equal(il, raw) and torch.equal(deinterleave_mxfp4(il), raw)
    for m in (1, 4, 7, 9, 40, 100):   # every tile of 1-8 rows, several tiles
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(dtype)
            want = x.float() @ w.T
            out = torch.empty(m, n, dtype=dtype)
            ops.ggml_linear(out, x, il, MXFP4_IL)
            tol = dict(atol=1e-5 * want.abs().max().item(), rtol=1e-5) if dtype == torch.float32 else \
                dict(atol=2e-2 * want.abs().max().item(), rtol=2e-2)
            torch.testing.assert_close(out.float(), want, **tol)
            if dtype == torch.bfloat16 and m > 1:
                alone = torch.empty(1, n, dtype=dtype)
                ops.ggml_linear(alone, x[m - 1:].contiguous(), il, MXFP4_IL)
                assert torch.equal(alone[0], out[m - 1]), "a row's result is its own, whatever the batch"
    with pytest.raises(RuntimeError, match="groups of 16"):
        ops.ggml_linear(torch.empty(1, 40, dtype=torch.bfloat16), torch.zeros(1, k, dtype=torch.bfloat16),
                        il[:40].contiguous(), MXFP4_IL)
    with pytest.raises(RuntimeError, match="R a multiple of 16"):
        ops.mxfp4_interleave(raw[:40].contiguous())


@pytest.mark.needs_cpu("avx512_vnni")   # the repacked MXFP4 kernel
def test_a_mixtures_mxfp4_experts_repacked_keep_their_weights_and_outputs():
    """interleave_experts repacks a mixture's MXFP4 stacks once: each expert's float weights are
    the same numbers after (the torch path's), and the layer's fp32 output is the same."""
    from types import SimpleNamespace

    from pagedllm.models.moe import SparseMoE, interleave_experts
    from pagedllm.models.moe_config import MoEConfig
    from pagedllm.models.ops import Ops

    g = torch.Generator().manual_seed(3)
    e, hid, width = 4, 64, 32
    moe = SparseMoE(SimpleNamespace(hidden_size=hid, activation="swiglu_oai",
                                    moe=MoEConfig(e, 2, width, True, router_bias=True, expert_bias=True,
                                                  blocks="MXFP4")))
    moe.w13_bias.data = torch.randn(e, 2 * width, generator=g) * 0.02
    moe.w2_bias.data = torch.randn(e, hid, generator=g) * 0.02
    moe.set_blocks(random_raw("MXFP4", e * 2 * width, hid, g), random_raw("MXFP4", e * hid, width, g))
    ops = Ops(load_ops())
    x = torch.randn(6, hid, generator=g)
    weights, chosen = torch.softmax(torch.randn(6, e, generator=g), -1).topk(2, -1)
    before = [moe.expert_weights(i, torch.float32) for i in range(e)]
    out = ops.experts(moe, x, weights.contiguous(), chosen)
    assert interleave_experts(moe, ops.k) == 2 and moe.interleaved and moe.block_args()[0] == 1039
    for (a13, a2), (b13, b2) in zip(before, (moe.expert_weights(i, torch.float32) for i in range(e))):
        assert torch.equal(a13, b13) and torch.equal(a2, b2)
    torch.testing.assert_close(ops.experts(moe, x, weights.contiguous(), chosen), out, atol=1e-5, rtol=1e-5)
    assert interleave_experts(moe, ops.k) == 0, "once"
