"""The engine with its float matmuls on reordered weights (the default on CPU, models/prepack.py:
bf16 in panels for our kernel where the CPU has AVX512-BF16, else for oneDNN) writes the same
tokens as with plain weights (PAGEDLLM_PREPACK=0), in both dtypes."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import load_ops
from pagedllm.models.prepack import can_prepack, is_packed, panels_wanted

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 5, 8,"] * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reordered_weights_write_the_same_tokens(monkeypatch, tiny_model, dtype):
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = {}
    panels = dtype == "bfloat16" and panels_wanted(load_ops())
    for wanted in ("0", "1", "onednn"):
        monkeypatch.setenv("PAGEDLLM_PREPACK", wanted)
        llm = LLM(model=tiny_model, dtype=dtype, kv_cache_memory="64MiB", max_model_len=256)
        modules = list(llm.engine.runner.model.modules())
        packed = sum(is_packed(m) for m in modules)
        # every matmul of the tiny model (4 a layer, and its untied LM head), where a kernel takes the dtype
        reorders = wanted != "0" and (can_prepack(torch.empty(1, 1, dtype=getattr(torch, dtype))) or panels)
        assert packed == (9 if reorders else 0)
        assert sum(hasattr(m, "panels") for m in modules) == (9 if wanted == "1" and panels else 0)
        outs[wanted] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        llm.engine.close()
    assert outs["0"] == outs["onednn"]   # oneDNN on plain or reordered weights: the same kernels, the same bits
    # panels sum each output in another order than oneDNN: the same greedy tokens all the same
    assert outs["0"] == outs["1"]
