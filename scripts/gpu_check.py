"""The GPU check (issue 6), after scripts/gpu_check.sh has run the kernel tests:

1. decode attention microbenchmark: batch 64 x context 2k, block size 16, bf16, a
   Llama-3-8B-like head layout (32 query heads, 8 KV heads, dim 128), blocks scattered at
   random in the pool. Achieved HBM bandwidth (bytes of K/V read / time) against the
   device's peak, and time against torch SDPA on the same K/V laid out contiguously;
2. engine offline throughput on a mixed-length workload against HF transformers
   `generate`, on a randomly initialised ~1B Llama (no model file, no network);
3. one summary table, and JSON.

    python scripts/gpu_check.py [--out results.json] [--device cpu --small]   (cpu: dry run)
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import os

import torch

if not torch.cuda.is_available():  # a CPU dry run: the kernels can only run interpreted, and
    os.environ.setdefault("TRITON_INTERPRET", "1")  # transformers may import triton before we do
sys.path.insert(0, str(Path(__file__).parent))
import gpu_smoke  # noqa: E402  (random Llama dirs, parity, throughput)

PEAK_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600, "L4": 300}


def peak_bandwidth(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((v for k, v in PEAK_GBS.items() if k in name), None)


def make_tokenizer(path: Path) -> Path:
    """A word-level tokenizer over the 49,152 ids the random models use: the check feeds
    token ids, so only the vocabulary size matters, and nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(49152)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(path)
    return path


def timed(fn, dev: str, iters: int) -> float:
    """Seconds per call (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def decode_microbench(dev: str, batch: int, ctx: int, block: int, heads: int, kv_heads: int, dim: int,
                      iters: int, peak_gbs: float | None) -> dict:
    from pagedllm.attention import triton_kernels as tk

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    nblk = -(-ctx // block)
    pool = batch * nblk + 16
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn((pool, block, kv_heads, dim), generator=g).to(dev, dtype)
    v_cache = torch.randn((pool, block, kv_heads, dim), generator=g).to(dev, dtype)
    ids = list(range(pool))
    random.Random(0).shuffle(ids)  # scattered, as a long-running server's pool is
    tables = torch.tensor([ids[i * nblk:(i + 1) * nblk] for i in range(batch)], dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((batch, heads, dim), generator=g).to(dev, dtype)
    out = torch.empty_like(q)
    scale = dim ** -0.5
    paged_s = timed(lambda: tk.paged_decode(q, k_cache, v_cache, tables, lens, scale, ctx, out=out), dev, iters)
    # The same K/V, contiguous per sequence, through SDPA.
    flat = tables.long().flatten()
    kc = k_cache[flat].view(batch, nblk * block, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    vc = v_cache[flat].view(batch, nblk * block, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    qs = q.unsqueeze(2)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)  # noqa: E731
    sdpa_s = timed(sdpa, dev, iters)
    err = (sdpa().squeeze(2).float() - out.float()).abs().max().item()
    kv_bytes = 2 * batch * ctx * kv_heads * dim * k_cache.element_size()
    gbs = kv_bytes / paged_s / 1e9
    return {"batch": batch, "context": ctx, "block_size": block, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
            "dtype": str(dtype), "kv_bytes": kv_bytes, "paged_us": paged_s * 1e6, "sdpa_contiguous_us": sdpa_s * 1e6,
            "paged_over_sdpa": paged_s / sdpa_s, "achieved_gbs": gbs, "peak_gbs": peak_gbs,
            "fraction_of_peak": gbs / peak_gbs if peak_gbs else None, "max_abs_diff_vs_sdpa": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a dry run on CPU")
    ap.add_argument("--peak-gbs", type=float, default=None, help="HBM peak if the device is not in the table")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = args.device
    gpu_smoke.DEV = dev
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    res: dict = {"device": name, "torch": torch.__version__}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None

    shape = dict(batch=4, ctx=200, block=16, heads=4, kv_heads=2, dim=32, iters=1) if args.small else \
        dict(batch=64, ctx=2048, block=16, heads=32, kv_heads=8, dim=128, iters=50)
    res["decode_attention"] = decode_microbench(dev, **shape, peak_gbs=peak_bandwidth(name, args.peak_gbs))
    print(json.dumps(res["decode_attention"]), flush=True)

    root = Path(tempfile.mkdtemp())
    tok = make_tokenizer(root / "tok")
    small, small_hf = gpu_smoke.make_dir(root, "small", tok, hidden_size=256, intermediate_size=704,
                                         num_hidden_layers=2 if args.small else 4, num_attention_heads=8,
                                         num_key_value_heads=2)
    res["parity"] = gpu_smoke.parity(small, small_hf)
    print(json.dumps(res["parity"]), flush=True)
    if args.small:
        big, _ = gpu_smoke.make_dir(root, "tiny", tok, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)
    else:
        big, _ = gpu_smoke.make_dir(root, "llama-1b", tok, hidden_size=2048, intermediate_size=5632,
                                    num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8)
    res["throughput"] = gpu_smoke.throughput(big, 8 if args.small else args.requests, args.hf_batch)

    d, t = res["decode_attention"], res["throughput"]
    frac = f"{100 * d['fraction_of_peak']:.0f} % of {d['peak_gbs']:.0f} GB/s" if d["fraction_of_peak"] else "peak unknown"
    rows = [
        ("decode attention, paged (Triton)", f"{d['paged_us']:.1f} us, {d['achieved_gbs']:.0f} GB/s ({frac})", "≥ 60 % of peak"),
        ("  vs SDPA on contiguous KV", f"{d['sdpa_contiguous_us']:.1f} us → paged/contiguous {d['paged_over_sdpa']:.2f}×",
         "≤ 1.3×"),
        ("  max |paged − SDPA|", f"{d['max_abs_diff_vs_sdpa']:.2e}", ""),
        ("greedy parity with HF (fp32)", f"{res['parity']['parity_equal']}/{res['parity']['parity_prompts']}", "all"),
        ("engine, mixed workload", f"{t['pagedllm_tok_s']:.0f} output tok/s", ""),
        (f"HF generate, batch {t['hf_batch']}", f"{t['hf_tok_s']:.0f} output tok/s → {t['ratio']:.2f}×", "≥ 3×"),
    ]
    print(f"\nGPU check on {name} (torch {res['torch']}, triton {res['triton']})")
    w = max(len(r[0]) for r in rows)
    for label, value, target in rows:
        print(f"  {label:<{w}}  {value:<52} {('target ' + target) if target else ''}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
