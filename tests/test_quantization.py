"""Weight-only quantization on llama.cpp blocks (`quantization="gguf" | "int8" | "int4"`): the
block kernels against the dequantized matmul, the GGUF file's blocks against its bf16
conversion, greedy output against bf16's, and bad settings refused."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import load_ops
from pagedllm.models.quantization import (Q4_1, Q8_0, Blocks, block_linear, dequantize, embed_rows,
                                          layer_blocks, quantize_q4_1, quantize_q8_0, set_blocks)


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
    # with a short last tile, many tiles, and chunks of rows (K=576: 222 rows of bf16 a chunk)
    for m in (1, 3, 5, 16, 40, 500):
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


def test_gguf_blocks_equal_the_converted_weights():
    """The file's own blocks, Q/K rows un-permuted, dequantize to the weights transformers'
    conversion (model_files.py, fp32) holds: every one of them, exactly."""
    from pagedllm.loader.gguf_quant import read_gguf_blocks, unpermute_rows
    from pagedllm.loader.model_files import default_gguf_path, load_config, load_weights, resolve_model_dir

    model_dir = resolve_model_dir(None)
    cfg = load_config(model_dir)
    blocks, skipped = read_gguf_blocks(default_gguf_path(), cfg["num_attention_heads"], cfg["num_key_value_heads"])
    weights = load_weights(model_dir)
    assert not skipped and len(blocks) == 7 * cfg["num_hidden_layers"] + 1
    assert {b.fmt for b in blocks.values()} == {Q4_1, Q8_0}
    for name, b in blocks.items():
        torch.testing.assert_close(b.dequantize(), weights[name].float(), atol=1e-7, rtol=0, msg=name)
    perm = unpermute_rows(576, 9)
    assert sorted(perm.tolist()) == list(range(576)) and perm[:4].tolist() == [0, 2, 4, 6]


def test_greedy_stays_with_bf16():
    """16 ShareGPT prompts, 32 greedy tokens against bf16's, at most 8 sequences a step so
    decode runs the block kernels (more rows dequantize to bf16, which for gguf gives bf16's
    very weights). Measured (common prefix, mean; first tokens equal): gguf 23.3, 16/16
    (bf16's weights before their rounding to bf16); int4 23.3, 16/16 (it recovers the
    file's blocks); int8 21.3, 16/16; bf16 against fp32 itself shares 37 of 64. A wrong
    layout, scale or row order would share next to nothing."""
    from pagedllm.bench.workloads import sharegpt_truncated

    prompts = [{"prompt_token_ids": list(r.prompt)} for r in sharegpt_truncated(16, 256, 32)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for q in (None, "gguf", "int4", "int8"):
        llm = LLM(dtype="bfloat16", quantization=q, max_model_len=1024, kv_cache_memory="128MiB", max_num_seqs=8)
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if q:
            assert f"{q} weights" in llm.engine.runner.describe()
    floors = {"gguf": 16, "int4": 16, "int8": 14}
    for q, floor in floors.items():
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 32) for x, y in zip(outs[None], outs[q])]
        assert sum(same) / len(same) >= floor, (q, same)
        assert sum(s > 0 for s in same) >= 13, (q, same)


def test_bad_quantization_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"quantization must be one of \('gguf', 'int8', 'int4', 'w8a8'\), got 'int3'"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="batch_invariant does not run int8 blocks"):
        LLM(quantization="int8", batch_invariant=True)
    with pytest.raises(ValueError, match="quantization gguf with tensor_parallel_size > 1"):
        LLM(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization 'gguf' runs a .gguf file's own blocks"):
        LLM(quantization="gguf", model=str(tmp_path))


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
    env = {**os.environ, "PAGEDLLM_CPU_ARCH": "x86-64-v3", "PAGEDLLM_CACHE": str(avx2_kernel_cache)}
    r = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_perplexity_of_a_fixed_text_stays_with_bf16():
    """Perplexity of a fixed 256-token text (ShareGPT replies), scored through the engine's
    prompt logprobs 8 tokens a step, so every matmul runs the block kernels. Measured: bf16
    8.361, gguf and int4 8.386 (the same blocks), int8 8.386; fp32 8.355. The floor: within
    2 % of bf16's. A wrong scale, row order or nibble order costs far more than that."""
    from pagedllm.bench.quality import fixed_text_ids, perplexity
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    ids = fixed_text_ids(load_tokenizer(resolve_model_dir(None)), 256)
    assert len(ids) == 256
    ppl = {q: perplexity(LLM(dtype="bfloat16", quantization=q, max_model_len=1024, kv_cache_memory="64MiB",
                             max_num_batched_tokens=8), ids) for q in (None, "gguf", "int4", "int8")}
    assert 2 < ppl[None] < 30, ppl
    for q in ("gguf", "int4", "int8"):
        assert ppl[q] <= 1.02 * ppl[None], ppl
