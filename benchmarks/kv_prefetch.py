"""The attention kernel's decode with and without its prefetch of the keys (kernels/csrc/attention.cpp:
prefetch_keys; PAGEDLLM_KV_PREFETCH=0 turns it off). A decode step's attention as the step runs it:
every layer's call over its own pool, so each block comes from memory, blocks scattered over twice
the space they fill (as in a busy pool), ShareGPT-like context lengths drawn per sequence; bf16 KV,
and int8 KV (codes and scales written by the kernel's own writer). Each
setting runs in a fresh process (the kernel reads the variable once), alternating, --rounds times;
the ratio of the medians. The bytes a second are the K and V the step reads.

    python -m benchmarks kv_prefetch --out benchmarks/results/kv_prefetch.json

End to end: `python -m benchmarks prepack_ab --env PAGEDLLM_KV_PREFETCH --variants off=0,on=1`.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.lib.attention import allocate_pool, fill_pool, median_time
from pagedllm.bench.throughput import in_own_process, save
from pagedllm.util import cdiv

# name: (sequences, shortest and longest context, (query heads, KV heads, head dim), layers, KV dtype)
SHAPES = {
    "smollm2 x 96, context 20-300": (96, 20, 300, (9, 3, 64), 30, "auto"),
    "smollm2 x 64, context 100-1200": (64, 100, 1200, (9, 3, 64), 30, "auto"),
    "smollm2 x 8, context 20-300": (8, 20, 300, (9, 3, 64), 30, "auto"),
    "smollm2 x 1, context 4000": (1, 4000, 4001, (9, 3, 64), 30, "auto"),
    "gemma3-270m x 32, context 20-300": (32, 20, 300, (4, 1, 256), 18, "auto"),
    "smollm2 x 96, context 20-300, int8 KV": (96, 20, 300, (9, 3, 64), 30, "int8"),
    "smollm2 x 64, context 100-1200, int8 KV": (64, 100, 1200, (9, 3, 64), 30, "int8"),
}


def step_attention(batch: int, lo: int, hi: int, heads: tuple[int, int, int], layers: int, kv_dtype: str,
                   reps: int) -> dict:
    from pagedllm.attention import StepLayout, get_backend
    from pagedllm.kv_dtype import resolve_kv_dtype

    g = torch.Generator().manual_seed(batch * 7919 + lo)
    h, kvh, d = heads
    block = 16
    ctx = torch.randint(lo, hi, (batch,), generator=g).tolist()
    nblk = [cdiv(c, block) for c in ctx]
    pool = 2 * sum(nblk)
    perm = torch.randperm(pool, generator=g)[:sum(nblk)].tolist()
    tables, i = [], 0
    for n in nblk:
        tables.append(perm[i:i + n])
        i += n
    cpu = get_backend("cpu")
    cpu.use_kv_dtype(resolve_kv_dtype(kv_dtype, "bfloat16"))
    kv = cpu.kv_dtype_of(torch.bfloat16)
    fmt = kv.fmt
    # decodes that write nothing (slot -1): attention alone is timed
    meta = cpu.build_metadata(StepLayout([-1] * batch, tables, ctx, list(range(batch + 1)), batch), "cpu")
    pools = []
    for _ in range(layers):
        kc, vc = (allocate_pool(s, cpu.pool_dtype(torch.bfloat16), torch.device("cpu"))
                  for s in cpu.cache_shapes(pool, block, kvh, d, torch.bfloat16))
        fill_pool(cpu, kv, kc, vc, pool * block, kvh, d, torch.bfloat16, g)
        pools.append((kc, vc))
    q = torch.randn(batch, h, d, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)

    def step() -> None:
        for kc, vc in pools:
            cpu.ops.paged_attention(out, q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                    d ** -0.5, True, fmt, 0)
    t = median_time(step, reps)   # its first call warms up
    kv_bytes = sum(ctx) * kvh * (kv.k_head_bytes(d) + kv.v_head_bytes(d)) * layers
    return {"step_ms": t * 1e3, "kv_gb_s": kv_bytes / t / 1e9, "mean_context": sum(ctx) / batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--out", default="benchmarks/results/kv_prefetch.json")
    args = ap.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for setting, value in (("off", "0"), ("on", "1")):
                runs[setting].append(in_own_process(step_attention, *shape, args.reps,
                                                    env={"PAGEDLLM_KV_PREFETCH": value}))
        off, on = (statistics.median(r["step_ms"] for r in runs[s]) for s in ("off", "on"))
        rows.append({"shape": name, "runs": runs, "median_off_ms": off, "median_on_ms": on, "speedup": off / on})
        print(f"{name}: without {off:.2f} ms a step ({runs['off'][0]['kv_gb_s']:.1f} GB/s), with {on:.2f} ms "
              f"({runs['on'][0]['kv_gb_s']:.1f} GB/s): {off / on:.2f}x")
    save({"args": vars(args), "rows": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
