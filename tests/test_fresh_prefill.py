"""Fresh prompts on torch's flash attention (attention/fresh_prefill.py) in the engine: the same
greedy tokens as on the paged kernel, for prompts alone and behind a cached prefix (which the
kernel reads), whichever path the route gives them."""
from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.chooser import Route

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 5, 8,"] * 2


def test_fresh_prefills_on_sdpa_write_the_kernels_tokens(monkeypatch, tiny_model):
    import pagedllm.attention.cpu_backend as cpu_backend

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for p in ("paged", "sdpa"):
        monkeypatch.setattr(cpu_backend, "fresh_route", lambda *a, p=p: Route((p,)))
        llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
        outs[p] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]   # prefix hits
        assert again == outs[p]
        assert llm.engine.runner.backend._routes, "the engine asked for the fresh chunks' route"
        llm.engine.close()
    assert outs["paged"] == outs["sdpa"]
