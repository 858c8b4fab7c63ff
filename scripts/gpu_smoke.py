"""CUDA smoke check of the engine (issue 2's "the same code runs on both"): on a GPU,
random-weight Llama models (no model file needed), greedy parity with HF transformers
in float32, then offline throughput against HF `generate` on a mixed-length workload.

    python scripts/gpu_smoke.py --tokenizer-dir DIR [--out results.json]

DIR holds a tokenizer (tokenizer.json, tokenizer_config.json) with a 49152-token vocab.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from pagedllm import LLM, SamplingParams


DEV = "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def make_dir(root: Path, name: str, tok_dir: Path, dtype: torch.dtype = torch.float32, **cfg_kw
             ) -> tuple[Path, tf.PreTrainedModel]:
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, **cfg_kw)
    # A big model is initialised on the device, in its dtype: seconds instead of a minute on the CPU.
    with torch.device(DEV if dtype != torch.float32 else "cpu"):
        model = tf.LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen them so greedy is stable
        model.lm_head.weight.mul_(8)
    out = root / name
    model.save_pretrained(out, safe_serialization=True)
    for f in tok_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out, model


def parity(path: Path, hf_model) -> dict:
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="2GiB", max_model_len=1024, device=DEV)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randint(3, 200))] for _ in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    hf = hf_model.to(DEV).float().eval()
    same = 0
    for ids, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids], device=DEV), max_new_tokens=24, min_new_tokens=24,
                               do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        same += o.outputs[0].token_ids == want
    hf.cpu()
    del llm
    empty_cache()
    return {"parity_prompts": len(prompts), "parity_equal": same, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu"}


def mixed_workload(n: int) -> list[tuple[list[int], int]]:
    """n requests: prompts of 16-512 token ids, 16-256 new tokens each."""
    rng = random.Random(1)
    return [([rng.randrange(3, 49000) for _ in range(rng.randint(16, 512))], rng.randint(16, 256)) for _ in range(n)]


def engine_throughput(path: Path, work: list[tuple[list[int], int]], **llm_kw) -> dict:
    out_tokens = sum(o for _, o in work)
    t0 = time.perf_counter()
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=2048, device=DEV,
              kv_cache_memory=None if DEV == "cuda" else "1GiB", **llm_kw)
    start_s = time.perf_counter() - t0  # load, profile run, KV allocation, CUDA-graph capture
    stats_blocks = llm.get_stats().kv.num_blocks
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    sync()
    t0 = time.perf_counter()
    llm.generate([p for p, _ in work], [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work],
                 use_tqdm=False)
    sync()
    secs = time.perf_counter() - t0
    res = {"requests": len(work), "output_tokens": out_tokens, "tok_s": out_tokens / secs, "seconds": secs,
           "startup_s": start_s, "kv_blocks": stats_blocks, "steps": llm.get_stats().steps, **llm_kw}
    if DEV == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["device_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    del llm
    empty_cache()
    return res


def hf_throughput(path: Path, work: list[tuple[list[int], int]], hf_batch: int) -> dict:
    """HF generate in batches of hf_batch (left-padded), each batch run to its longest output."""
    out_tokens = sum(o for _, o in work)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
    t0 = time.perf_counter()
    for i in range(0, len(work), hf_batch):
        chunk = work[i:i + hf_batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=DEV)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=DEV)
        new = max(o for _, o in chunk)
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)
    sync()
    secs = time.perf_counter() - t0
    del hf
    empty_cache()
    return {"hf_batch": hf_batch, "tok_s": out_tokens / secs, "seconds": secs}


def throughput(path: Path, n: int, hf_batch: int) -> dict:
    work = mixed_workload(n)
    ours, base = engine_throughput(path, work), hf_throughput(path, work, hf_batch)
    return {"requests": n, "output_tokens": ours["output_tokens"], "pagedllm_tok_s": ours["tok_s"],
            "hf_tok_s": base["tok_s"], "hf_batch": hf_batch, "ratio": ours["tok_s"] / base["tok_s"],
            "kv_blocks": ours["kv_blocks"], "steps": ours["steps"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu only to dry-run this script")
    ap.add_argument("--big-layers", type=int, default=16)
    args = ap.parse_args()
    global DEV
    DEV = args.device
    tok_dir = Path(args.tokenizer_dir)
    root = Path(tempfile.mkdtemp())
    res: dict = {"torch": torch.__version__}
    small, small_hf = make_dir(root, "small", tok_dir, hidden_size=256, intermediate_size=704,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    res.update(parity(small, small_hf))
    print(json.dumps(res), flush=True)
    big = make_dir(root, "llama-1b", tok_dir, torch.bfloat16, hidden_size=2048, intermediate_size=5632,
                   num_hidden_layers=args.big_layers, num_attention_heads=32, num_key_value_heads=8)[0]
    empty_cache()
    res.update(throughput(big, args.requests, args.hf_batch))
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
