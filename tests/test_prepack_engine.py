"""The engine with its float matmuls on reordered weights (the default on CPU, models/prepack.py)
writes the same tokens as with plain weights (PAGEDLLM_PREPACK=0), in both dtypes."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.prepack import can_prepack

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 5, 8,"] * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reordered_weights_write_the_same_tokens(monkeypatch, tiny_model, dtype):
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = {}
    for wanted in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_PREPACK", wanted)
        llm = LLM(model=tiny_model, dtype=dtype, kv_cache_memory="64MiB", max_model_len=256)
        packed = sum(hasattr(m, "packed") for m in llm.engine.runner.model.modules())
        # every matmul of the tiny model (4 a layer, and its untied LM head), where oneDNN takes the dtype
        assert packed == (9 if wanted == "1" and can_prepack(torch.empty(1, 1, dtype=getattr(torch, dtype))) else 0)
        outs[wanted] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        llm.engine.close()
    assert outs["0"] == outs["1"]
