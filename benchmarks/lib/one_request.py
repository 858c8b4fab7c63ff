"""One request's decode speed on our engine: warmed up, then one greedy request stepped alone,
its first step (prefill and first token) timed apart from the rest."""
from __future__ import annotations

import time


def ours_one_request(engine_kwargs: dict, ids: list[int], new: int) -> dict:
    """{"runner", "ttft_s", "decode_tok_s"} for `ids` and `new` tokens (EOS ignored)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    llm.generate([[2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    eng = llm.engine
    eng.add_request(None, ids, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    t0 = time.perf_counter()
    eng.step()  # the prefill and the first token
    t1 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    t2 = time.perf_counter()
    return {"runner": eng.runner.describe(), "ttft_s": t1 - t0, "decode_tok_s": (new - 1) / (t2 - t1)}
