"""One person, one laptop: one request at a time, PagedLLM's variants against llama.cpp on
the same GGUF file (issue 17's targets).

Workloads (the same token ids for every engine; greedy; each engine in its own process,
one warm-up request first, then every request one after another):
  chat   8 ShareGPT first turns (long ones cut to 256 tokens, not dropped), chat-templated,
         up to 256 new tokens, stopping at EOS
  code   a code-editing request: a 40-line source file and "rename this variable, give
         the whole file back" (where n-gram lookup shines), up to 512 new tokens, EOS stops
  anchor the issue's anchor: a 64-token random prompt, 256 new tokens, EOS ignored
Figure: output tokens / wall time over the workload (prefill included), and the ratio to
llama.cpp's in the same run. PagedLLM's variants: weights (bf16, or a --quantization) and
speculative decoding (ngram k=4) on or off.

    python -m benchmarks single_request --variants bf16,bf16+ngram,gguf,gguf+ngram \\
        --out benchmarks/results/single_request_spec_quant.json
    python -m benchmarks single_request --dtype float32 --variants fp32,gguf,int4 \\
        --out benchmarks/results/single_request_avx2.json   # a CPU without native bf16
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
CODE_FILE = Path(__file__).resolve().parents[1] / "pagedllm" / "kv" / "block_table.py"


def workloads() -> dict[str, list[tuple[list[int], int, bool]]]:
    """name -> [(prompt ids, max new tokens, ignore_eos)]."""
    from pagedllm.bench.workloads import sharegpt_truncated
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))

    def chat(text: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    chats = [chat(tok.decode(r.prompt)) for r in sharegpt_truncated(8, 256, 256)]
    code = chat("Rename the variable `out` to `result` in this Python file. Reply with the whole file.\n\n"
                + CODE_FILE.read_text())
    rng = random.Random(0)
    return {"chat": [(p, 256, False) for p in chats], "code": [(code, 512, False)],
            "anchor": [([rng.randrange(0, 10000) for _ in range(64)], 256, True)]}


def run_pagedllm(variant: str, work: dict, dtype: str = "bfloat16") -> dict:
    from pagedllm import LLM, SamplingParams

    weights, _, spec = variant.partition("+")
    llm = LLM(dtype=dtype, max_model_len=2048, quantization=None if weights in ("bf16", "fp32") else weights,
              speculative_config=NGRAM if spec == "ngram" else None)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    out = {"engine": f"pagedllm {variant}", "runner": llm.engine.runner.describe()}
    for name, reqs in work.items():
        n, t0 = 0, time.perf_counter()
        for ids, max_tokens, ignore_eos in reqs:
            o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=ignore_eos), use_tqdm=False)
            n += len(o[0].outputs[0].token_ids)
        dt = time.perf_counter() - t0
        out[name] = {"output_tokens": n, "elapsed_s": dt, "output_tok_s": n / dt}
    s = llm.engine.stats()
    if s.spec is not None:
        out["spec"] = {"acceptance_rate": s.spec.acceptance_rate, "mean_accepted_length": s.spec.mean_accepted_length,
                       "drafts": s.spec.num_drafts}
    return out


def run_llama_cpp(work: dict) -> dict:
    from benchmarks.lib.baselines import _llama
    from pagedllm.loader.model_files import default_gguf_path

    llm = _llama(default_gguf_path(), n_ctx=2048)
    eos = llm.token_eos()

    def one(ids: list[int], max_tokens: int, ignore_eos: bool) -> int:
        llm.reset()
        n = 0
        for t in llm.generate(ids, temp=0.0, reset=True):
            if t == eos and not ignore_eos:
                break
            n += 1
            if n >= max_tokens:
                break
        return n
    one([1, 2, 3, 4], 8, True)
    out = {"engine": "llama.cpp Q4_1 (llama-cpp-python, high-level API)"}
    for name, reqs in work.items():
        t0 = time.perf_counter()
        n = sum(one(*r) for r in reqs)
        dt = time.perf_counter() - t0
        out[name] = {"output_tokens": n, "elapsed_s": dt, "output_tok_s": n / dt}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="bf16,bf16+ngram",
                    help="comma list of WEIGHTS[+ngram]; WEIGHTS: bf16 / fp32 (the float weights) or a "
                         "--quantization value")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="activations (and float weights): float32 on a CPU without native bf16")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/single_request_spec_quant.json")
    args = ap.parse_args()
    work = workloads()
    runs = [] if args.skip_llama_cpp else [in_own_process(run_llama_cpp, work)]
    runs += [in_own_process(run_pagedllm, v, work, args.dtype) for v in args.variants.split(",")]
    base = runs[0]
    print(f"{'engine':44s}" + "".join(f"{w:>22s}" for w in work))
    for r in runs:
        cells = "".join(f"{r[w]['output_tok_s']:8.1f} tok/s {r[w]['output_tok_s'] / base[w]['output_tok_s']:5.2f}x"
                        f"  " for w in work)
        print(f"{r['engine']:44s}{cells}" + (f"  acceptance {r['spec']['acceptance_rate']:.0%}" if "spec" in r else ""))
    save({"workloads": {w: {"requests": len(v), "max_new_tokens": v[0][1], "ignore_eos": v[0][2],
                            "prompt_tokens": [len(p) for p, _, _ in v]} for w, v in work.items()},
          "baseline": base["engine"], "runs": runs}, args.out)


if __name__ == "__main__":
    main()
