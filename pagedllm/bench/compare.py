"""`pagedllm bench compare`: every baseline on one workload, same model, one run."""
from __future__ import annotations

import logging

from ..loader import default_gguf_path, resolve_model_dir
from .baselines import hf_generate, llama_cpp_available, llama_cpp_batched, llama_cpp_sequential
from .throughput import run_engine

logger = logging.getLogger(__name__)


def run_compare(reqs, workload: str, engine_kwargs: dict, hf_batch_sizes: list[int], llama_batch: int,
                llama_sequential_requests: int, skip: set[str] = frozenset()) -> list[dict]:
    results = []

    def add(r: dict) -> None:
        r["workload"] = workload
        results.append(r)
        if "output_tok_s" in r:
            logger.info("%-45s %8.1f output tok/s", r["engine"], r["output_tok_s"])
        else:
            logger.info("%-45s skipped: %s", r["engine"], r.get("skipped"))

    if "pagedllm" not in skip:
        add(run_engine(reqs, {**engine_kwargs, "enable_prefix_caching": True}, label="pagedllm paged + prefix cache"))
        add(run_engine(reqs, {**engine_kwargs, "enable_prefix_caching": False}, label="pagedllm paged, no prefix cache"))
        add(run_engine(reqs, {**engine_kwargs, "allocation": "reserve-max"}, label="pagedllm reserve-max"))
    dtype = engine_kwargs.get("dtype", "bfloat16")
    dtype = "bfloat16" if dtype == "auto" else dtype
    if "hf" not in skip:
        model_dir = resolve_model_dir(engine_kwargs.get("model"))
        for bs in hf_batch_sizes:
            add(hf_generate(reqs, model_dir, dtype, bs))
    if "llama.cpp" not in skip:
        reason = llama_cpp_available()
        if reason:
            add({"engine": "llama.cpp", "skipped": reason})
        else:
            gguf = engine_kwargs.get("model") or default_gguf_path()
            if not str(gguf).endswith(".gguf"):
                add({"engine": "llama.cpp", "skipped": "the model is not a GGUF file"})
            else:
                add(llama_cpp_batched(reqs, gguf, llama_batch))
                sub = reqs[:llama_sequential_requests]  # one at a time is slow: a prefix of the list
                r = llama_cpp_sequential(sub, gguf)
                r["note"] = f"first {len(sub)} requests only"
                add(r)
    return results


def print_compare(results: list[dict]) -> None:
    print(f"{'engine':<48}{'output tok/s':>14}{'total tok/s':>14}{'req/s':>9}")
    for r in results:
        if "output_tok_s" not in r:
            print(f"{r['engine']:<48}{'skipped: ' + r['skipped']}")
            continue
        print(f"{r['engine']:<48}{r['output_tok_s']:>14.1f}{r['total_tok_s']:>14.1f}{r['requests_per_s']:>9.2f}")
    ours = next((r for r in results if r["engine"].startswith("pagedllm paged + prefix")), None)
    if ours is None:
        return
    for prefix in ("hf-transformers", "llama.cpp batched", "pagedllm reserve-max"):
        base = [r for r in results if r["engine"].startswith(prefix) and "output_tok_s" in r]
        if base:
            best = max(base, key=lambda r: r["output_tok_s"])
            print(f"pagedllm / best {prefix} ({best['engine']}): {ours['output_tok_s'] / best['output_tok_s']:.2f}x")
