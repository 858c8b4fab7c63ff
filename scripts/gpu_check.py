"""The GPU check (issue 6), after scripts/gpu_check.sh has run the kernel tests:

1. decode attention microbenchmark: batch 64 x context 2k, block size 16, bf16, a
   Llama-3-8B-like head layout (32 query heads, 8 KV heads, dim 128), blocks scattered at
   random in the pool. Achieved HBM bandwidth (bytes of K/V read / time) against the
   device's peak, and time against torch SDPA on the same K/V laid out contiguously;
   a sweep of the kernel's launch parameters (partition, tile, warps), and two more shapes
   (one long context, many short ones);
2. greedy parity with HF transformers (fp32, small random Llama);
3. engine offline throughput on a mixed-length workload, with and without CUDA graphs,
   against HF transformers `generate`, on a randomly initialised ~1B Llama (no model
   file, no network);
4. one summary table, and JSON (rewritten after every part, so a run cut short keeps
   what it measured). A part that fails is recorded and the others still run.

    python scripts/gpu_check.py [--out results.json] [--device cpu --small]   (cpu: dry run)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # a CPU dry run: the kernels can only run interpreted, and
    os.environ.setdefault("TRITON_INTERPRET", "1")  # transformers may import triton before we do
sys.path.insert(0, str(Path(__file__).parent))
import gpu_smoke  # noqa: E402  (random Llama dirs, parity, throughput)

from pagedllm.util import cdiv  # noqa: E402

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


def decode_inputs(dev: str, batch: int, ctx: int, block: int, heads: int, kv_heads: int, dim: int) -> dict:
    """A pool with each sequence's blocks scattered at random (as a long-running server's
    are), the same K/V laid out contiguously for SDPA, and a query per sequence."""
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    nblk = cdiv(ctx, block)
    pool = batch * nblk + 16
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn((pool, block, kv_heads, dim), generator=g).to(dev, dtype)
    v_cache = torch.randn((pool, block, kv_heads, dim), generator=g).to(dev, dtype)
    ids = list(range(pool))
    random.Random(0).shuffle(ids)
    tables = torch.tensor([ids[i * nblk:(i + 1) * nblk] for i in range(batch)], dtype=torch.int32, device=dev)
    flat = tables.long().flatten()
    kc = k_cache[flat].view(batch, nblk * block, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    vc = v_cache[flat].view(batch, nblk * block, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    q = torch.randn((batch, heads, dim), generator=g).to(dev, dtype)
    return {"k_cache": k_cache, "v_cache": v_cache, "tables": tables, "kc": kc, "vc": vc, "q": q,
            "lens": torch.full((batch,), ctx, dtype=torch.int32, device=dev), "ctx": ctx,
            "kv_bytes": 2 * batch * ctx * kv_heads * dim * k_cache.element_size(), "scale": dim ** -0.5,
            "shape": {"batch": batch, "context": ctx, "block_size": block, "heads": heads, "kv_heads": kv_heads,
                      "head_dim": dim, "dtype": str(dtype)}}


def paged_call(x: dict, out: torch.Tensor, **cfg):
    from pagedllm.attention import triton_kernels as tk
    return lambda: tk.paged_decode(x["q"], x["k_cache"], x["v_cache"], x["tables"], x["lens"], x["scale"], x["ctx"],
                                   out=out, **cfg)


def decode_microbench(dev: str, iters: int, peak_gbs: float | None, **shape) -> dict:
    """Paged decode (engine defaults) vs SDPA on contiguous K/V: time, GB/s, fraction of peak."""
    x = decode_inputs(dev, **shape)
    out = torch.empty_like(x["q"])
    paged_s = timed(paged_call(x, out), dev, iters)
    qs = x["q"].unsqueeze(2)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        qs, x["kc"], x["vc"], scale=x["scale"], enable_gqa=True)
    sdpa_s = timed(sdpa, dev, iters)
    err = (sdpa().squeeze(2).float() - out.float()).abs().max().item()
    gbs = x["kv_bytes"] / paged_s / 1e9
    return {**x["shape"], "kv_bytes": x["kv_bytes"], "paged_us": paged_s * 1e6, "sdpa_contiguous_us": sdpa_s * 1e6,
            "paged_over_sdpa": paged_s / sdpa_s, "achieved_gbs": gbs, "sdpa_gbs": x["kv_bytes"] / sdpa_s / 1e9,
            "peak_gbs": peak_gbs, "fraction_of_peak": gbs / peak_gbs if peak_gbs else None,
            "max_abs_diff_vs_sdpa": err}


def decode_sweep(dev: str, iters: int, configs: list[dict], **shape) -> list[dict]:
    """The decode kernel's launch parameters, each timed on the same inputs: tuning data
    from one run of the GPU machine."""
    x = decode_inputs(dev, **shape)
    want = torch.empty_like(x["q"])
    paged_call(x, want)()
    rows = []
    for cfg in configs:
        out = torch.empty_like(x["q"])
        try:
            secs = timed(paged_call(x, out, **cfg), dev, iters)
            rows.append({**cfg, "us": secs * 1e6, "gbs": x["kv_bytes"] / secs / 1e9,
                         "max_abs_diff": (out.float() - want.float()).abs().max().item()})
        except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
            rows.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return rows


SWEEP = [{"partition": p, "tile": t, "num_warps": w} for p in (256, 512, 1024) for t in (32, 64, 128) for w in (4, 8)]
EXTRA_SHAPES = {"long context, batch 8 x 32k": dict(batch=8, ctx=32768),
                "short context, batch 256 x 512": dict(batch=256, ctx=512)}


def section(res: dict, key: str, out: str | None, fn) -> None:
    """One part of the check; a failure is recorded and the rest still runs."""
    t0 = time.perf_counter()
    try:
        res[key] = fn()
    except Exception as e:
        traceback.print_exc()
        res[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    print(f"[{key}: {time.perf_counter() - t0:.1f} s] {json.dumps(res[key], default=str)[:1500]}", flush=True)
    if out:  # after every part: a run cut short by a time limit keeps what it measured
        Path(out).write_text(json.dumps(res, indent=2, default=str))


def ok(x) -> bool:
    return isinstance(x, dict) and "error" not in x


def summary(res: dict) -> list[tuple[str, str, str]]:
    rows = []
    d = res.get("decode_attention")
    if ok(d):
        frac = f"{100 * d['fraction_of_peak']:.0f} % of {d['peak_gbs']:.0f} GB/s" if d["fraction_of_peak"] \
            else "peak unknown"
        rows += [("decode attention, paged (Triton)", f"{d['paged_us']:.1f} us, {d['achieved_gbs']:.0f} GB/s ({frac})",
                  "≥ 60 % of peak"),
                 ("  vs SDPA on contiguous KV", f"{d['sdpa_contiguous_us']:.1f} us → paged/contiguous "
                  f"{d['paged_over_sdpa']:.2f}×", "≤ 1.3×"),
                 ("  max |paged − SDPA|", f"{d['max_abs_diff_vs_sdpa']:.2e}", "")]
    else:
        rows.append(("decode attention", f"FAILED: {d and d.get('error')}", ""))
    sw = res.get("decode_sweep")
    if isinstance(sw, list):
        good = [r for r in sw if "error" not in r]
        if good:
            b = min(good, key=lambda r: r["us"])
            rows.append(("  best launch config of the sweep", f"partition {b['partition']}, tile {b['tile']}, "
                         f"{b['num_warps']} warps: {b['us']:.1f} us, {b['gbs']:.0f} GB/s", ""))
    for name in EXTRA_SHAPES:
        e = res.get(f"decode {name}")
        if ok(e):
            rows.append((f"  {name}", f"{e['achieved_gbs']:.0f} GB/s, paged/SDPA {e['paged_over_sdpa']:.2f}×", ""))
    p = res.get("parity")
    rows.append(("greedy parity with HF (fp32)", f"{p['parity_equal']}/{p['parity_prompts']}" if ok(p)
                 else f"FAILED: {p and p.get('error')}", "all"))
    p = res.get("parity_tp1_group")
    rows.append(("  same, TP=1 through the process group", f"{p['parity_equal']}/{p['parity_prompts']}" if ok(p)
                 else f"FAILED: {p and p.get('error')}", "all"))
    hf = res.get("hf_generate")
    for key, label in (("engine_cuda_graphs", "engine, CUDA graphs"), ("engine_eager", "engine, eager")):
        e = res.get(key)
        if ok(e):
            ratio = f" → {e['tok_s'] / hf['tok_s']:.2f}× HF" if ok(hf) else ""
            rows.append((f"{label}, mixed workload", f"{e['tok_s']:.0f} output tok/s{ratio} "
                         f"({e['kv_blocks']} KV blocks, start {e['startup_s']:.0f} s)", "≥ 3×"))
        elif e is not None:
            rows.append((label, f"FAILED: {e.get('error')}", ""))
    if ok(hf):
        rows.append((f"HF generate, batch {hf['hf_batch']}", f"{hf['tok_s']:.0f} output tok/s", ""))
    return rows


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
    dev, small, out = args.device, args.small, args.out
    gpu_smoke.DEV = dev
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    res: dict = {"device": name, "torch": torch.__version__}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    peak = peak_bandwidth(name, args.peak_gbs)
    heads = dict(heads=4, kv_heads=2, dim=32) if small else dict(heads=32, kv_heads=8, dim=128)
    main_shape = dict(batch=4, ctx=200, block=16, **heads) if small else dict(batch=64, ctx=2048, block=16, **heads)
    iters = 1 if small else 50
    section(res, "decode_attention", out, lambda: decode_microbench(dev, iters, peak, **main_shape))
    sweep = SWEEP[:2] if small else SWEEP
    section(res, "decode_sweep", out, lambda: decode_sweep(dev, max(1, iters // 2), sweep, **main_shape))
    for label, shp in EXTRA_SHAPES.items():
        shp = dict(batch=2, ctx=700) if small else shp
        section(res, f"decode {label}", out,
                lambda shp=shp: decode_microbench(dev, max(1, iters // 2), peak, block=16, **heads, **shp))

    root = Path(tempfile.mkdtemp())
    tok = make_tokenizer(root / "tok")

    small_model: list = []

    def parity():
        if not small_model:
            small_model.extend(gpu_smoke.make_dir(root, "small", tok, hidden_size=256, intermediate_size=704,
                                                  num_hidden_layers=2 if small else 4, num_attention_heads=8,
                                                  num_key_value_heads=2))
        return gpu_smoke.parity(*small_model)
    section(res, "parity", out, parity)

    def parity_tp_group():
        """TP=1 through the tensor-parallel code path: a process group of one (NCCL on
        CUDA), vocab-parallel embedding, all-reduces, logits gathered, plans broadcast."""
        os.environ["PAGEDLLM_TP_GROUP"] = "1"
        try:
            return parity()
        finally:
            os.environ.pop("PAGEDLLM_TP_GROUP")
    section(res, "parity_tp1_group", out, parity_tp_group)

    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if small else \
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers, num_attention_heads=32,
             num_key_value_heads=8)
    big = gpu_smoke.make_dir(root, "llama", tok, torch.bfloat16, **size)[0]  # the HF copy is dropped here
    gpu_smoke.empty_cache()
    work = gpu_smoke.mixed_workload(8 if small else args.requests)
    res["workload"] = {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
                       "output_tokens": sum(o for _, o in work)}
    # Graphs need CUDA and the Triton backend; on a CPU dry run both runs are eager.
    section(res, "engine_cuda_graphs", out, lambda: gpu_smoke.engine_throughput(big, work))
    section(res, "engine_eager", out, lambda: gpu_smoke.engine_throughput(big, work, enforce_eager=True))
    section(res, "hf_generate", out, lambda: gpu_smoke.hf_throughput(big, work, args.hf_batch))

    rows = summary(res)
    print(f"\nGPU check on {name} (torch {res['torch']}, triton {res['triton']})")
    w = max(len(r[0]) for r in rows)
    for label, value, target in rows:
        print(f"  {label:<{w}}  {value:<64} {('target ' + target) if target else ''}")
    if out:
        Path(out).write_text(json.dumps(res, indent=2, default=str))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
