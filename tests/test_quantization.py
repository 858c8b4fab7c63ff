"""Weight-only quantization on llama.cpp blocks (`quantization="gguf" | "int8" | "int4"`): the
block kernels against the dequantized matmul, the GGUF file's blocks against its bf16
conversion, greedy output against bf16's, and bad settings refused."""
from __future__ import annotations


import pytest
from hw import FAST_DTYPE
import torch

from pagedllm import SamplingParams
from pagedllm.models.quantization import (Q4_1, Q8_0)


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


@pytest.fixture(scope="module")
def quantized(make_llm):
    """One engine per weight format (None: unquantized), in the dtype this CPU runs fast, shared
    by the greedy and the perplexity checks: decode runs the block kernels' paths of up to 6 rows
    (4 sequences), prefill and the scored text their tiled one."""
    llms = {q: make_llm(dtype=FAST_DTYPE, quantization=q, max_model_len=1024, kv_cache_memory="128MiB", max_num_seqs=8)
            for q in (None, "gguf", "int4", "int8")}
    yield llms
    for llm in llms.values():
        llm.close()


def test_greedy_stays_with_unquantized(quantized):
    """4 ShareGPT prompts cut to 128 tokens, 32 greedy tokens against the unquantized weights'.
    Measured (common prefix, mean; first tokens equal), fp32 on an AVX2 CPU, of 8 prompts: gguf
    32.0, 8/8; int4 32.0, 8/8; int8 23.3, 8/8. Earlier, bf16 on an AVX-512 BF16 CPU, 16 prompts: gguf and
    int4 23.3, int8 21.3, 16/16; bf16 against fp32 itself shares 37 of 64. A wrong layout,
    scale or row order would share next to nothing."""
    from pagedllm.bench.workloads import sharegpt_truncated

    prompts = [{"prompt_token_ids": list(r.prompt)} for r in sharegpt_truncated(4, 128, 32)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for q, llm in quantized.items():
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if q:
            assert f"{q} weights" in llm.engine.runner.describe()
    floors = {"gguf": 14, "int4": 14, "int8": 12}
    for q, floor in floors.items():
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 32) for x, y in zip(outs[None], outs[q])]
        assert sum(same) / len(same) >= floor, (q, same)
        assert sum(s > 0 for s in same) >= 3, (q, same)


def test_perplexity_of_a_fixed_text_stays_with_unquantized(quantized):
    """Perplexity of a fixed 256-token text (ShareGPT replies), scored through the engine's
    prompt logprobs 64 tokens a step, through the block kernels' tiled path of more than 6 rows
    (the one prefill takes; the greedy test runs the decode path). Measured: bf16
    8.361, gguf and int4 8.386 (the same blocks), int8 8.386; fp32 8.355. The floor: within
    2 % of the unquantized weights'. A wrong scale, row order or nibble order costs far more."""
    from pagedllm.bench.quality import fixed_text_ids, perplexity
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    ids = fixed_text_ids(load_tokenizer(resolve_model_dir(None)), 256)
    assert len(ids) == 256
    ppl = {}
    for q, llm in quantized.items():
        sched = llm.engine.scheduler
        budget, sched.max_num_batched_tokens = sched.max_num_batched_tokens, 64
        try:
            ppl[q] = perplexity(llm, ids)
        finally:
            sched.max_num_batched_tokens = budget
    assert 2 < ppl[None] < 30, ppl
    for q in ("gguf", "int4", "int8"):
        assert ppl[q] <= 1.02 * ppl[None], ppl
