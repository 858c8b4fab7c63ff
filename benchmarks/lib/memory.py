"""`pagedllm bench memory`: the PagedAttention paper's memory-benefit claims, from counters of real runs.

- paged vs reserve-max under one KV budget: waste, utilization, concurrency, throughput;
- prefix sharing on chat / RAG / eval: hit rate H, and blocks saved against
  M_saved = N_p * B * bytes * (R - 1);
- parallel sampling n > 1: blocks saved by sharing the prompt;
- beam search k = 2, 4, 6: blocks saved by beams sharing blocks (fork, copy-on-write)
  against every beam holding its own copy, beside the paper's 37.6-66.3 %;
- block size sweep: waste against throughput.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from pagedllm.bench.throughput import run_engine
from pagedllm.bench.workloads import WorkloadOptions, load_workload

logger = logging.getLogger(__name__)


def _common_prefix_len(tok, reqs) -> int:
    ids = [r.prompt if isinstance(r.prompt, list) else tok.encode(r.prompt, add_special_tokens=False) for r in reqs]
    n = min(map(len, ids))
    for i in range(n):
        if any(x[i] != ids[0][i] for x in ids):
            return i
    return n


def _slim(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "steps"}


def paged_vs_reserve(tok, kw: dict, opts: WorkloadOptions) -> dict:
    reqs = load_workload("sharegpt", tok, opts)
    base = {**kw, "enable_prefix_caching": False}
    paged = run_engine(reqs, base, label="paged", passes=1)
    reserve = run_engine(reqs, {**base, "allocation": "reserve-max"}, label="reserve-max", passes=1)
    paged["workload"] = reserve["workload"] = "sharegpt"
    return {"paged": paged, "reserve_max": reserve,
            "concurrency_ratio": paged["max_concurrent_seqs"] / max(1, reserve["max_concurrent_seqs"]),
            "throughput_ratio": paged["output_tok_s"] / reserve["output_tok_s"]}


def prefix_sharing(tok, kw: dict, opts: WorkloadOptions, workloads=("chat-shared-system", "rag-doc-qa", "batch-eval")) -> list[dict]:
    out = []
    for w in workloads:
        reqs = load_workload(w, tok, opts)
        r = run_engine(reqs, {**kw, "enable_prefix_caching": True}, label=f"paged + prefix cache ({w})", passes=1)
        r["workload"] = w
        B = kw.get("block_size", 16)
        n_p = _common_prefix_len(tok, reqs) // B
        best = max(r["steps"], key=lambda s: s["blocks_without_sharing"] - s["used_blocks"])
        saved = best["blocks_without_sharing"] - best["used_blocks"]
        R = best["running_seqs"]
        r.update({"shared_prefix_blocks": n_p, "sharing_requests_at_peak": R,
                  "measured_saved_blocks": saved, "formula_saved_blocks": n_p * max(0, R - 1),
                  "measured_saved_bytes": saved * r["bytes_per_block"],
                  "formula_saved_bytes": n_p * max(0, R - 1) * r["bytes_per_block"]})
        out.append(r)
    return out


def parallel_sampling(tok, kw: dict, opts: WorkloadOptions, n: int = 4) -> dict:
    reqs = load_workload("sharegpt", tok, opts)
    r = run_engine(reqs, {**kw, "enable_prefix_caching": False}, n=n, temperature=0.8, label=f"paged n={n}", passes=1)
    r["workload"] = "sharegpt"
    fracs = [1 - s["used_blocks"] / s["blocks_without_sharing"] for s in r["steps"] if s["blocks_without_sharing"]]
    r["mean_blocks_saved_frac"] = sum(fracs) / max(1, len(fracs))
    r["max_blocks_saved_frac"] = max(fracs, default=0.0)
    return r


# The vLLM paper's beam-search savings (Kwon et al., SOSP 2023, section 6.3), by dataset.
PAPER_BEAM_SAVING = {"alpaca": (0.376, 0.552), "sharegpt": (0.443, 0.663)}


def beam_sharing(tok, kw: dict, opts: WorkloadOptions, widths=(2, 4, 6)) -> list[dict]:
    """Beam search on ShareGPT prompts and on short instructions (ShareGPT first turns cut
    to 32 tokens, Alpaca-like): blocks held with sharing against every beam its own copy,
    per step. No prefix cache: the sharing measured is the beams' own."""
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import BeamSearchParams

    llm = LLM(**{**kw, "enable_prefix_caching": False})
    sets = {"sharegpt": dataclasses.replace(opts, truncate=True),
            "short-instructions": dataclasses.replace(opts, max_prompt_len=32, truncate=True)}
    out = []
    for name, o in sets.items():
        prompts = [{"prompt_token_ids": list(r.prompt)} for r in load_workload("sharegpt", tok, o)]
        for k in widths:
            llm.engine.step_log = []
            t0 = time.perf_counter()
            res = llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=o.max_output_len))
            dt = time.perf_counter() - t0
            steps, llm.engine.step_log = llm.engine.step_log, None
            fracs = [1 - s["used_blocks"] / s["blocks_without_sharing"] for s in steps if s["blocks_without_sharing"]]
            peak = max(steps, key=lambda s: s["blocks_without_sharing"])
            tokens = sum(len(s.tokens) - len(p["prompt_token_ids"]) for r, p in zip(res, prompts) for s in r.sequences)
            prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
            out.append({"engine": f"pagedllm beam k={k} ({name})", "workload": name, "beam_width": k,
                        "num_requests": len(prompts), "elapsed_s": dt, "output_tokens": tokens,
                        "prompt_tokens": prompt_tokens, "output_tok_s": tokens / dt,
                        "total_tok_s": (tokens + prompt_tokens) / dt, "requests_per_s": len(prompts) / dt,
                        "max_concurrent_seqs": max(s["running_seqs"] for s in steps),
                        "peak_kv_usage": max(s["usage"] for s in steps),
                        "mean_waste": sum(s["waste"] for s in steps) / len(steps),
                        "mean_blocks_saved_frac": sum(fracs) / max(1, len(fracs)),
                        "saved_frac_at_peak": 1 - peak["used_blocks"] / max(1, peak["blocks_without_sharing"]),
                        "peak_blocks_without_sharing": peak["blocks_without_sharing"],
                        "peak_blocks_used": max(s["used_blocks"] for s in steps),
                        "paper_range": PAPER_BEAM_SAVING["sharegpt" if name == "sharegpt" else "alpaca"]})
    return out


def block_size_sweep(tok, kw: dict, opts: WorkloadOptions, sizes=(1, 8, 16, 32, 64, 128)) -> list[dict]:
    reqs = load_workload("sharegpt", tok, opts)
    out = []
    for b in sizes:
        r = run_engine(reqs, {**kw, "block_size": b, "enable_prefix_caching": False}, label=f"block size {b}", passes=1)
        r["workload"], r["block_size"] = "sharegpt", b
        out.append(r)
    return out


def run_memory_analysis(tok, kw: dict, opts: WorkloadOptions, parts: set[str]) -> dict:
    res: dict = {"options": opts.as_dict(), "engine": kw}
    if "reserve" in parts:
        res["paged_vs_reserve"] = paged_vs_reserve(tok, kw, opts)
    if "prefix" in parts:
        res["prefix_sharing"] = prefix_sharing(tok, kw, opts)
    if "n" in parts:
        res["parallel_sampling"] = parallel_sampling(tok, kw, opts)
    if "beam" in parts:
        res["beam_sharing"] = beam_sharing(tok, kw, opts)
    if "block-size" in parts:
        res["block_size_sweep"] = block_size_sweep(tok, kw, opts)
    return res


def flatten(res: dict) -> list[dict]:
    """The runs inside a memory-analysis result, for the report."""
    runs = []
    pv = res.get("paged_vs_reserve")
    if pv:
        runs += [pv["paged"], pv["reserve_max"]]
    runs += res.get("prefix_sharing", [])
    if res.get("parallel_sampling"):
        runs.append(res["parallel_sampling"])
    runs += res.get("beam_sharing", [])
    runs += res.get("block_size_sweep", [])
    return runs


def print_memory(res: dict) -> None:
    pv = res.get("paged_vs_reserve")
    if pv:
        print("Paged vs reserve-max (same KV budget, sharegpt):")
        for r in (pv["paged"], pv["reserve_max"]):
            print(f"  {r['engine']:<12} max concurrent {r['max_concurrent_seqs']:>4}  mean waste {r['mean_waste']:6.1%}  "
                  f"peak usage {r['peak_kv_usage']:6.1%}  {r['output_tok_s']:7.1f} output tok/s")
        print(f"  concurrency x{pv['concurrency_ratio']:.1f}, throughput x{pv['throughput_ratio']:.2f}")
    for r in res.get("prefix_sharing", []):
        print(f"Prefix sharing, {r['workload']}: H = {r['prefix_hit_rate']:.1%}; at peak {r['sharing_requests_at_peak']} "
              f"requests share {r['shared_prefix_blocks']} prefix blocks: saved {r['measured_saved_blocks']} blocks "
              f"({r['measured_saved_bytes'] / 2**20:.1f} MiB) vs formula N_p*(R-1) = {r['formula_saved_blocks']} "
              f"({r['formula_saved_bytes'] / 2**20:.1f} MiB)")
    ps = res.get("parallel_sampling")
    if ps:
        print(f"Parallel sampling n={ps['n']}: blocks saved by sharing, mean {ps['mean_blocks_saved_frac']:.1%}, "
              f"max {ps['max_blocks_saved_frac']:.1%}")
    for r in res.get("beam_sharing", []):
        lo, hi = r["paper_range"]
        print(f"Beam search k={r['beam_width']} ({r['workload']}): blocks saved by sharing, mean "
              f"{r['mean_blocks_saved_frac']:.1%}, at peak {r['saved_frac_at_peak']:.1%} "
              f"(paper: {lo:.1%}-{hi:.1%}); {r['output_tok_s']:.1f} output tok/s")
    for r in res.get("block_size_sweep", []):
        print(f"Block size {r['block_size']:>3}: mean waste {r['mean_waste']:6.1%}, {r['output_tok_s']:7.1f} output tok/s")
