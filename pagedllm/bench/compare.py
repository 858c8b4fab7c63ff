"""`pagedllm bench compare`: every baseline on one workload, same model and token ids,
each engine in its own fresh process, in one run."""
from __future__ import annotations

import logging
from pathlib import Path

from ..loader import default_gguf_path, resolve_model_dir
from .baselines import (hf_generate, hf_generate_batch, llama_cpp_available, llama_cpp_batched,
                        llama_cpp_sequential)
from .throughput import in_own_process, run_engine
from .vllm_baseline import run_vllm_offline, vllm_python

logger = logging.getLogger(__name__)

PARTS = ("pagedllm", "variants", "vllm", "hf", "hf-batch", "llama.cpp")


def run_compare(reqs, workload: str, engine_kwargs: dict, hf_batch_sizes: list[int], llama_batch: int,
                llama_sequential_requests: int, skip: set[str] = frozenset(), vllm_venv: Path | None = None,
                setup_vllm: bool = False) -> list[dict]:
    results = []

    def add(r: dict) -> None:
        r["workload"] = workload
        results.append(r)
        if "output_tok_s" in r:
            logger.info("%-48s %8.1f output tok/s", r["engine"], r["output_tok_s"])
        else:
            logger.info("%-48s skipped: %s", r["engine"], r.get("skipped"))

    def own(label: str, fn, *args, **kw) -> None:
        try:
            add(in_own_process(fn, *args, **kw))
        except Exception as e:  # one baseline failing must not lose the others' figures
            logger.exception("%s failed", label)
            add({"engine": label, "skipped": f"failed: {type(e).__name__}: {e}"})

    model_dir = resolve_model_dir(engine_kwargs.get("model"))
    dtype = engine_kwargs.get("dtype", "bfloat16")
    dtype = "bfloat16" if dtype == "auto" else dtype
    if "pagedllm" not in skip:
        own("pagedllm", run_engine, reqs, engine_kwargs, label="pagedllm", use_tqdm=False)
    if "variants" not in skip:
        own("pagedllm, no prefix cache", run_engine, reqs, {**engine_kwargs, "enable_prefix_caching": False},
            label="pagedllm, no prefix cache", use_tqdm=False)
        own("pagedllm reserve-max", run_engine, reqs, {**engine_kwargs, "allocation": "reserve-max"},
            label="pagedllm reserve-max", use_tqdm=False)
    if "vllm" not in skip:
        python, why = vllm_python(vllm_venv, create=setup_vllm)
        if why:
            add({"engine": "vllm-cpu", "skipped": why})
        else:
            try:
                for r in run_vllm_offline(reqs, model_dir, python, _kv_bytes(engine_kwargs),
                                          engine_kwargs.get("max_model_len") or 2048, dtype):
                    add(r)
            except Exception as e:
                logger.exception("vLLM failed")
                add({"engine": "vllm-cpu", "skipped": f"failed: {e}"})
    if "hf" not in skip:
        for bs in hf_batch_sizes:
            own(f"hf-transformers bs={bs}", hf_generate, reqs, model_dir, dtype, bs)
    if "hf-batch" not in skip:
        own("hf-transformers generate_batch", hf_generate_batch, reqs, model_dir, dtype)
    if "llama.cpp" not in skip:
        reason = llama_cpp_available()
        gguf = engine_kwargs.get("model") or default_gguf_path()
        if reason:
            add({"engine": "llama.cpp", "skipped": reason})
        elif not str(gguf).endswith(".gguf"):
            add({"engine": "llama.cpp", "skipped": "the model is not a GGUF file"})
        else:
            own("llama.cpp batched", llama_cpp_batched, reqs, gguf, llama_batch)
            sub = reqs[:llama_sequential_requests]  # one at a time is slow: a prefix of the list
            before = len(results)
            own("llama.cpp sequential", llama_cpp_sequential, sub, gguf)
            if len(results) > before and "output_tok_s" in results[-1]:
                results[-1]["note"] = f"first {len(sub)} requests only"
    return results


def _kv_bytes(engine_kwargs: dict) -> int:
    """Our KV budget, handed to vLLM too (VLLM_CPU_KVCACHE_SPACE)."""
    import torch

    from ..config import EngineConfig
    from ..runtime.kv_cache import kv_budget

    return kv_budget(EngineConfig(**engine_kwargs), torch.device("cpu"))


def _best(results: list[dict], prefix: str) -> dict | None:
    rs = [r for r in results if r["engine"].startswith(prefix) and "output_tok_s" in r and r.get("pass") != "cold"]
    return max(rs, key=lambda r: r["output_tok_s"]) if rs else None


def print_compare(results: list[dict]) -> None:
    print(f"{'engine':<50}{'output tok/s':>14}{'total tok/s':>14}{'req/s':>9}{'cold/warm':>11}")
    for r in results:
        if "output_tok_s" not in r:
            print(f"{r['engine']:<50}{'skipped: ' + r['skipped']}")
            continue
        cw = f"{r['cold_over_warm']:.2f}" if r.get("cold_over_warm") else ""
        print(f"{r['engine']:<50}{r['output_tok_s']:>14.1f}{r['total_tok_s']:>14.1f}{r['requests_per_s']:>9.2f}"
              f"{cw:>11}")
    ours = _best(results, "pagedllm")
    ours = next((r for r in results if r["engine"] == "pagedllm" and "output_tok_s" in r), ours)
    if ours is None:
        return
    print()
    for prefix, what in (("vllm-cpu", "vLLM CPU backend (warm)"), ("hf-transformers bs", "HF generate, best static batch"),
                         ("hf-transformers generate_batch", "HF generate_batch"),
                         ("llama.cpp batched", "llama.cpp batched"), ("pagedllm reserve-max", "our reserve-max")):
        base = _best(results, prefix)
        if base:
            print(f"pagedllm / {what} ({base['engine']}): {ours['output_tok_s'] / base['output_tok_s']:.2f}x")
    vllm_cold = next((r for r in results if r.get("pass") == "cold" and "output_tok_s" in r), None)
    if ours.get("cold") and vllm_cold:
        print(f"cold passes: pagedllm {ours['cold']['output_tok_s']:.1f} vs vLLM {vllm_cold['output_tok_s']:.1f} "
              f"output tok/s ({ours['cold']['output_tok_s'] / vllm_cold['output_tok_s']:.2f}x)")
    if ours.get("cold_over_warm"):
        print(f"pagedllm cold / warm: {ours['cold_over_warm']:.2f}")
