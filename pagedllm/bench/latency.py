"""`pagedllm bench latency`: vLLM's `vllm bench latency`, end-to-end time of one batch.

A batch of `batch_size` random prompts of `input_len` tokens, each generating exactly
`output_len` tokens (ignore_eos), timed over `num_iters` runs after `num_iters_warmup`.
The JSON has vLLM's keys: avg_latency, latencies, percentiles.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

PERCENTILES = (10, 25, 50, 75, 90, 99)


def run_latency(engine_kwargs: dict[str, Any], input_len: int, output_len: int, batch_size: int, n: int = 1,
                num_iters_warmup: int = 10, num_iters: int = 30, seed: int = 0) -> dict:
    from ..engine.llm import LLM
    from ..sampling_params import SamplingParams

    if min(input_len, output_len, batch_size, n, num_iters) < 1 or num_iters_warmup < 0:
        raise ValueError("input_len, output_len, batch_size, n and num_iters must be >= 1, "
                         "num_iters_warmup >= 0")
    llm = LLM(**engine_kwargs)
    # Random token ids below 10000, as vLLM's dummy prompts (and inside a small vocabulary).
    rng = np.random.default_rng(seed)
    high = min(10000, llm.engine.model_cfg.vocab_size)
    prompts = [{"prompt_token_ids": rng.integers(0, high, size=input_len).tolist()} for _ in range(batch_size)]
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)

    def once() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        made = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if made != batch_size * n * output_len:  # a short run would flatter the latency
            raise RuntimeError(f"generated {made} tokens, expected {batch_size * n * output_len}")
        return dt

    for _ in range(num_iters_warmup):
        once()
    latencies = [once() for _ in range(num_iters)]
    return {"input_len": input_len, "output_len": output_len, "batch_size": batch_size, "n": n,
            "num_iters_warmup": num_iters_warmup, "num_iters": num_iters, "engine_kwargs": engine_kwargs,
            "avg_latency": float(np.mean(latencies)), "latencies": latencies,
            "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES}}


def print_latency(r: dict) -> None:
    """vLLM's lines: the average, then each percentile."""
    print(f"Avg latency: {r['avg_latency']} seconds")
    for p, v in r["percentiles"].items():
        print(f"{p}% percentile latency: {v} seconds")
