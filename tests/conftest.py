from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir():
    from pagedllm.loader import resolve_model_dir

    return resolve_model_dir(None)  # the default SmolLM2 GGUF, converted once into the cache


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def llm_fp32():
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)
