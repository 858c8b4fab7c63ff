"""LLM.embed (vLLM's offline pooling) on the default model: last-token pooling held to HF
transformers' last hidden state, a cached prefix not computed again, and the pooling
helpers (normalizing, Matryoshka truncation, cosine)."""
from __future__ import annotations

import math

import torch

from pagedllm.pooling import cosine, pooled

PREAMBLE = "A long shared instruction that every document in this batch starts with, word for word. " * 4


def test_embed_equals_hf_and_reuses_a_cached_prefix(llm_fp32, hf_model):
    docs = [PREAMBLE + "First document.", PREAMBLE + "Second document, a little longer."]
    first = llm_fp32.embed(docs[:1], use_tqdm=False, normalize=False)[0]
    second = llm_fp32.embed(docs[1:], use_tqdm=False, normalize=False)[0]
    assert second.num_cached_tokens >= 32, "the shared preamble's blocks were computed again"
    for out in (first, second):
        with torch.inference_mode():
            want = hf_model.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=2e-4)
    unit = llm_fp32.embed(docs[:1], use_tqdm=False)[0].outputs.embedding
    assert math.isclose(math.sqrt(sum(x * x for x in unit)), 1.0, rel_tol=1e-6)
    llm_fp32.engine.kv.check_integrity()


def test_pooling_helpers():
    assert pooled([3.0, 4.0]) == [0.6, 0.8] and pooled([3.0, 4.0], normalize=False) == [3.0, 4.0]
    assert pooled([3.0, 4.0, 12.0], dimensions=2) == [0.6, 0.8]
    assert pooled([0.0, 0.0]) == [0.0, 0.0]
    assert math.isclose(cosine([1.0, 0.0], [1.0, 1.0]), math.sqrt(0.5)) and cosine([0.0], [1.0]) == 0.0
