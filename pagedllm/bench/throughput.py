"""`pagedllm bench throughput`: offline throughput of this engine on a workload."""
from __future__ import annotations

import time

from ..sampling_params import SamplingParams
from .provenance import save_result
from .sharegpt import BenchRequest


def run_engine(reqs: list[BenchRequest], engine_kwargs: dict, n: int = 1, temperature: float = 0.0,
               use_tqdm: bool = True, label: str = "pagedllm", passes: int = 2) -> dict:
    """Generate every request (ignore_eos, max_tokens = its output length) in one batch,
    `passes` times in this process: the first is cold (a fresh engine, nothing warmed
    up), the last is reported, with the first's figures beside it. Returns throughput,
    the engine's counters and a per-step KV record of the last pass."""
    from ..engine import LLM

    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    llm = LLM(**engine_kwargs)
    engine = llm.engine
    params = [SamplingParams(n=n, temperature=temperature, seed=i if temperature else None,
                             max_tokens=r.output_len, ignore_eos=True) for i, r in enumerate(reqs)]
    cold = None
    for i in range(passes):
        llm.reset_prefix_cache()  # every pass starts from an empty prefix cache
        start = engine.stats()
        engine.step_log = []
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=use_tqdm)
        dt = time.perf_counter() - t0
        if i == 0:
            cold = {"elapsed_s": dt, "output_tok_s": sum(len(c.token_ids) for o in outs for c in o.outputs) / dt}
    st = engine.stats()
    steps, engine.step_log = engine.step_log, None
    out_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    prompt_tok = sum(len(o.prompt_token_ids) for o in outs)
    hits, queries = st.kv.prefix_hits - start.kv.prefix_hits, st.kv.prefix_queries - start.kv.prefix_queries
    return {
        "engine": label, "config": {k: v for k, v in engine_kwargs.items()}, "n": n,
        "runner": engine.runner.describe(),
        "num_requests": len(reqs), "elapsed_s": dt, "requests_per_s": len(reqs) / dt,
        "output_tokens": out_tok, "prompt_tokens": prompt_tok,
        "output_tok_s": out_tok / dt, "total_tok_s": (out_tok + prompt_tok) / dt,
        "cold": cold, "cold_over_warm": cold["output_tok_s"] / (out_tok / dt) if passes > 1 else None,
        "computed_tok_s": (st.computed_prompt_tokens - start.computed_prompt_tokens
                           + st.generation_tokens - start.generation_tokens) / dt,
        "max_concurrent_seqs": max((s["batch_seqs"] for s in steps), default=0),
        "mean_batch_seqs": sum(s["batch_seqs"] for s in steps) / max(1, len(steps)),
        "peak_kv_usage": max((s["usage"] for s in steps), default=0.0),
        "mean_kv_usage": sum(s["usage"] for s in steps) / max(1, len(steps)),
        "mean_waste": sum(s["waste"] for s in steps) / max(1, len(steps)),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "prefix_hits": hits, "prefix_queries": queries,
        "max_blocks_saved_by_sharing": max((s["blocks_without_sharing"] - s["used_blocks"] for s in steps), default=0),
        "bytes_per_block": st.bytes_per_block,
        "stats": st.as_dict(), "steps": steps,
    }


def in_own_process(fn, *args, env: dict[str, str] | None = None, **kwargs):
    """fn(*args, **kwargs) in a fresh process (spawned, not forked): every engine of a
    comparison starts cold, with its own oneDNN kernel cache and thread pool. env: variables
    set in that process before fn runs (engine knobs read at load: PAGEDLLM_PREPACK, ...),
    not in this one."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                             initializer=_set_env, initargs=(env or {},)) as ex:
        return ex.submit(fn, *args, **kwargs).result()


def _set_env(env: dict[str, str]) -> None:
    import os

    os.environ.update(env)


def print_throughput(r: dict) -> None:
    print(f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tok_s']:.2f} total tokens/s, "
          f"{r['output_tok_s']:.2f} output tokens/s")
    print(f"  {r['num_requests']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens in "
          f"{r['elapsed_s']:.1f} s; max {r['max_concurrent_seqs']} concurrent sequences; "
          f"KV usage peak {r['peak_kv_usage']:.1%}, mean waste {r['mean_waste']:.1%}; "
          f"prefix hit rate {r['prefix_hit_rate']:.1%}")


def save(result: dict | list, path: str) -> None:
    """A result file, with its provenance (the scripts under benchmarks/ call it by this name)."""
    save_result(result, path)
