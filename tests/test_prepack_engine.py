"""The engine with its float matmuls on reordered weights (the default on CPU, models/prepack.py:
bf16 in panels for our kernel or for oneDNN, whichever the chooser timed faster here; each
forceable) writes the same tokens as with plain weights (PAGEDLLM_PREPACK=0), in both dtypes."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import load_ops
from pagedllm.models.prepack import can_prepack, is_packed, layer_path, panels_wanted

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 5, 8,"] * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reordered_weights_write_the_same_tokens(monkeypatch, tiny_model, dtype):
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = {}
    panels = dtype == "bfloat16" and panels_wanted(load_ops())
    for wanted in ("0", "1", "onednn", "panels"):
        monkeypatch.setenv("PAGEDLLM_PREPACK", wanted)
        llm = LLM(model=tiny_model, dtype=dtype, kv_cache_memory="64MiB", max_model_len=256)
        modules = list(llm.engine.runner.model.modules())
        packed = sum(is_packed(m) for m in modules)
        # every matmul of the tiny model (4 a layer, and its untied LM head), where a kernel takes the dtype
        reorders = wanted != "0" and (can_prepack(torch.empty(1, 1, dtype=getattr(torch, dtype))) or panels)
        assert packed == (9 if reorders else 0)
        assert sum(hasattr(m, "panels") for m in modules) == (9 if wanted == "panels" and panels else 0) \
            or wanted == "1"   # the default: whichever path the chooser timed faster for each shape here
        assert sum(layer_path(m) is not None for m in modules) == (9 if reorders else 0)
        outs[wanted] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        llm.engine.close()
    assert outs["0"] == outs["onednn"]   # oneDNN on plain or reordered weights: the same kernels, the same bits
    # panels sum each output in another order than oneDNN: the same greedy tokens all the same
    assert outs["0"] == outs["1"] == outs["panels"]


@pytest.mark.needs_cpu("avx512_bf16")
def test_greedy_rows_take_their_tokens_without_logits(monkeypatch, tiny_model):
    """In bf16 on panels, a greedy row nobody reads the logits of gets its token from the head's
    argmax kernel (Ops.argmax), the rows beside it (logprobs, sampling) their logits as before:
    the same prompts greedy with and without logprobs write the same tokens in one batch."""
    monkeypatch.setenv("PAGEDLLM_PREPACK", "panels")   # the head on panels whatever the chooser would time
    assert panels_wanted(load_ops()), "the CPU has AVX512-BF16 but the kernels were built without the panels"
    llm = LLM(model=tiny_model, dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=256)
    model = llm.engine.runner.model
    seen = {"argmax": 0, "logits": 0}
    greedy_tokens, compute_logits = model.greedy_tokens, model.compute_logits

    def counted(name, f):
        def g(h):
            seen[name] += h.shape[0]
            return f(h)
        return g

    model.greedy_tokens, model.compute_logits = counted("argmax", greedy_tokens), counted("logits", compute_logits)
    prompts = PROMPTS[:4]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    outs = llm.generate(prompts * 3, [plain] * 4 + [scored] * 4 + [sampled] * 4)
    llm.engine.close()
    assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in outs[4:8]]
    assert all(len(o.outputs[0].logprobs) == 12 for o in outs[4:8])
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs[8:])
    assert seen["argmax"] == 4 * 12            # every plain greedy token, and no other
    assert seen["logits"] == 8 * 12            # the logprobs and the sampled rows only
