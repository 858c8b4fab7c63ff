"""LFM2 from a GGUF file against llama.cpp on the same file: LFM2-350M's shape (hybrid_state.SHAPE)
with SmolLM2's 49,152-token vocabulary (llama.cpp takes the tokenizer's count as the embedding's
rows), random weights written as llama.cpp's converter lays LFM2 out (benchmarks/lib/gguf_files.py),
made once under the cache: Q8_0 matmuls (norms and the convolutions' taps F32), an F32 twin, and
Q4_K_M made from the F32 file by llama.cpp's own quantizer (llama_model_quantize: its Q4_K / Q6_K
mix, as the files people download are made).

Parts (each engine in its own process, one after another, the same token ids, greedy, EOS ignored):
  check   the F32 file, 4 ShareGPT prompts cut to 256 tokens, 32 new tokens: llama.cpp's greedy
          tokens against ours (float32, the file's values) - the two engines' reading of one file
  single  the --quant file (Q8_0 or Q4_K_M), one request (a ShareGPT prompt cut to 256 tokens, 128 new): decode tok/s
          after the first token; ours on the file's blocks (`quantization="gguf"`) and on its
          values in bf16
  batch   the --quant file, 32 ShareGPT prompts cut to 256 tokens, 64 new tokens each: ours in one
          batch against llama.cpp's continuous batching over 32 slots and its one-at-a-time API

    python -m benchmarks lfm2_gguf --out benchmarks/results/lfm2_gguf_llama_cpp.json
    python -m benchmarks lfm2_gguf --parts single,batch --quant Q4_K_M --out benchmarks/results/lfm2_gguf_llama_cpp_q4km.json
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save

VOCAB = 49152


def files() -> dict[str, Path]:
    """{"Q8_0": path, "F32": path, "Q4_K_M": path}: the GGUF files, written once beside the random model
    (Q4_K_M by llama.cpp's quantizer: the benchmark needs llama-cpp-python anyway)."""
    from benchmarks.hybrid_state import SHAPE
    from benchmarks.lib.gguf_files import write_gguf
    from benchmarks.lib.random_models import random_model
    from pagedllm.loader.model_files import default_gguf_path

    shape = {**SHAPE, "vocab_size": VOCAB}
    src = random_model("hybrid-bench", f"lfm2-350m-shape-v{VOCAB}", "Lfm2Config", shape)
    out = {q: src / f"lfm2-350m-shape.{q}.gguf" for q in ("Q8_0", "F32")}
    if not all(p.is_file() for p in out.values()):
        import torch
        import transformers as tf

        model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        for q, path in out.items():
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            write_gguf(model, tmp, "lfm2", q, default_gguf_path())
            os.replace(tmp, path)
    out["Q4_K_M"] = src / "lfm2-350m-shape.Q4_K_M.gguf"
    if not out["Q4_K_M"].is_file():
        _llama_quantize(out["F32"], out["Q4_K_M"])
    return out


def _llama_quantize(src: Path, dst: Path) -> None:
    """dst: src quantized to Q4_K_M by llama.cpp's own quantizer (its choice of Q4_K and Q6_K per tensor)."""
    import ctypes

    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread = lc.LLAMA_FTYPE_MOSTLY_Q4_K_M, os.cpu_count() or 1
    tmp = dst.with_suffix(f".tmp-{os.getpid()}")
    if lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")
    os.replace(tmp, dst)


def llama_tokens(gguf: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    from benchmarks.lib.baselines import _llama

    llm = _llama(gguf, n_ctx=max(map(len, prompts)) + new + 8)
    out = []
    for ids in prompts:
        llm.reset()
        got = []
        for tok in llm.generate(ids, temp=0.0, reset=True):
            got.append(int(tok))
            if len(got) >= new:
                break
        out.append(got)
    return out


def ours_tokens(gguf: str, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list[list[float]]]:
    """Our greedy tokens on the file's float32 values, and at each step the gap between the two
    best logprobs (a near tie is where two engines' sums in another order may part)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=gguf, dtype="float32", max_model_len=1024)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    gaps = [[_top2_gap(step) for step in o.outputs[0].logprobs] for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], gaps


def _top2_gap(step: dict) -> float:
    """The gap between a step's two best logprobs."""
    best, second = sorted((x.logprob for x in step.values()), reverse=True)[:2]
    return best - second


def _agreeing(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy runs share before their first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    from benchmarks.gemma3 import llama_single
    from benchmarks.lib.baselines import batch_against_llama_cpp, llama_cpp_available, single_against_llama_cpp
    from benchmarks.moe import ours_batch, ours_single, requests

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="check,single,batch")
    p.add_argument("--quant", default="Q8_0", choices=["Q8_0", "Q4_K_M"], help="the file single and batch run")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    why = llama_cpp_available()
    if why:
        raise SystemExit(why)
    parts, paths = set(a.parts.split(",")), files()
    gguf, f32 = str(paths[a.quant]), str(paths["F32"])
    res: dict = {"benchmark": "lfm2_gguf", "quant": a.quant, "files": {k: str(v) for k, v in paths.items()},
                 "vocab_size": VOCAB}
    if "check" in parts:
        prompts = [r.prompt for r in requests(4, 256, 32)]
        theirs = in_own_process(llama_tokens, f32, prompts, 32)
        ours, gaps = in_own_process(ours_tokens, f32, prompts, 32)
        same = [_agreeing(x, y) for x, y in zip(theirs, ours)]
        at = [g[n] if n < 32 else None for g, n in zip(gaps, same)]
        res["check"] = {"llama_cpp": theirs, "ours": ours, "tokens_agreeing_before_first_difference": same,
                        "identical": sum(x == 32 for x in same), "our_top2_logprob_gap_where_they_part": at,
                        "our_smallest_top2_gap_any_step": min(min(g) for g in gaps)}
        print(f"check (F32 file): {res['check']['identical']}/4 prompts give llama.cpp's 32 greedy tokens; "
              f"tokens agreeing before the first difference {same}; our top-two logprob gap there {at}")
    variants = ["gguf", None]
    if "single" in parts:
        ids = list(requests(1, 256, 128)[0].prompt)
        res["single"] = single_against_llama_cpp(llama_single, gguf, ids, 128,
                                                 [(ours_single, (gguf, ids, 128, q)) for q in variants])
    if "batch" in parts:
        reqs = requests(32, 256, 64)
        res["batch"] = batch_against_llama_cpp(reqs, gguf, f"{a.quant} GGUF", [
            (ours_batch, (gguf, reqs, "pagedllm " + (q or "bf16")), {"quantization": q}) for q in variants])
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
