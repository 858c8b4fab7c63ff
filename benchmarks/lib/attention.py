"""`pagedllm bench attention`: decode attention of one layer against its memory floor.

For each batch x context, the CPU kernel and the torch reference read the same logical
KV (each in its own pool layout, blocks scattered over a pool 2x larger than needed).
The floor is the time to stream the K/V bytes once at this machine's copy bandwidth,
measured here on a buffer of the same size (STREAM's convention: bytes read + bytes
written per second), so kernel / floor = 1 means memory speed.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from pagedllm.attention import StepLayout, get_backend
from pagedllm.kv_dtype import resolve_kv_dtype
from pagedllm.runtime.kv_cache import allocate_pool
from pagedllm.util import cdiv


def copy_bandwidth(nbytes: int, reps: int = 9) -> float:
    """Bytes moved (read + written) per second by a copy of nbytes, median of reps."""
    n = max(nbytes, 1 << 22) // 4
    a, b = torch.ones(n), torch.empty(n)
    b.copy_(a)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t0)
    return 2 * 4 * n / statistics.median(ts)


def median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fill_pool(cpu, kv, kc: torch.Tensor, vc: torch.Tensor, slots: int, kvh: int, d: int, dtype: torch.dtype,
              g: torch.Generator) -> None:
    """Random K/V in a CPU backend's pool of `slots` tokens: quantized kinds through the kernel's
    own writer (codes and scales as the engine writes them, from normal values), others directly."""
    if not kv.quantized:
        kc.copy_(torch.randn(kc.shape, generator=g))
        vc.copy_(torch.randn(vc.shape, generator=g))
        return
    for i in range(0, slots, 8192):
        n = min(8192, slots - i)
        cpu.ops.write_kv(torch.randn(n, kvh, d, generator=g).to(dtype), torch.randn(n, kvh, d, generator=g).to(dtype),
                         kc, vc, torch.arange(i, i + n), kv.fmt)


def bench_decode(batch: int, context: int, heads=(9, 3, 64), block_size: int = 16, dtype=torch.bfloat16,
                 reps: int = 15, reference: bool = True, kv_cache_dtype: str = "auto") -> dict:
    """kv_cache_dtype: how the kernel's pool stores K/V (quantized kinds are filled by the
    kernel's own writer, from normal values); the reference always reads dtype."""
    h, kvh, d = heads
    nblk = cdiv(context, block_size)
    pool = 2 * batch * nblk  # blocks scattered over twice the space, as in a busy pool
    g = torch.Generator().manual_seed(batch * 7919 + context)
    tables = torch.randperm(pool, generator=g)[:batch * nblk].view(batch, nblk).to(torch.int32)
    q = torch.randn(batch, h, d, generator=g).to(dtype)
    # Decodes that write nothing (slot -1): attention alone is timed.
    layout = StepLayout([-1] * batch, tables.tolist(), [context] * batch, list(range(batch + 1)), batch)
    cpu = get_backend("cpu")
    cpu.use_kv_dtype(resolve_kv_dtype(kv_cache_dtype, str(dtype).removeprefix("torch.")))
    kv = cpu.kv_dtype_of(dtype)
    kv_bytes = batch * context * kvh * (kv.k_head_bytes(d) + kv.v_head_bytes(d))  # what the kernel reads
    out = {"batch": batch, "context": context, "heads": list(heads), "block_size": block_size,
           "dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": kv.name, "kv_bytes": kv_bytes}
    meta = cpu.build_metadata(layout, "cpu")
    # Pools as the engine allocates them (huge pages), then filled.
    fmt = kv.fmt
    kc, vc = (allocate_pool(s, cpu.pool_dtype(dtype), torch.device("cpu"))
              for s in cpu.cache_shapes(pool, block_size, kvh, d, dtype))
    fill_pool(cpu, kv, kc, vc, pool * block_size, kvh, d, dtype, g)
    ops = cpu.ops
    res = torch.empty_like(q)
    out["kernel_s"] = median_time(lambda: ops.paged_attention(res, q, kc, vc, meta.block_tables, meta.seq_lens,
                                                         meta.query_start_loc, d ** -0.5, True, fmt), reps)
    kc = vc = None  # free the pools before the next ones
    if reference:
        ref = get_backend("torch")
        rk, rv = (allocate_pool(s, dtype, torch.device("cpu")).copy_(torch.randn(s, generator=g))
                  for s in ref.cache_shapes(pool, block_size, kvh, d, dtype))
        meta = ref.build_metadata(dataclasses.replace(layout, slots=[]), "cpu")
        k0 = torch.zeros(0, kvh, d, dtype=dtype)

        def run_ref():  # attention only: the reference's write of zero new tokens is free
            ref.forward(q, k0, k0, rk, rv, meta, d ** -0.5)
        out["reference_s"] = median_time(run_ref, max(3, reps // 3))
        rk = rv = None
    bw = copy_bandwidth(kv_bytes)
    out["copy_bandwidth_gbs"] = bw / 1e9
    out["floor_s"] = kv_bytes / bw
    out["kernel_over_floor"] = out["kernel_s"] / out["floor_s"]
    out["kernel_read_gbs"] = kv_bytes / out["kernel_s"] / 1e9
    return out


def run_attention_bench(batches: list[int], contexts: list[int], reference: bool = True) -> list[dict]:
    rows = []
    for b in batches:
        for c in contexts:
            r = bench_decode(b, c, reference=reference)
            rows.append(r)
            ref = f"{r['reference_s'] * 1e3:9.3f}" if "reference_s" in r else ""
            print(f"batch {b:4d} context {c:5d}: kernel {r['kernel_s'] * 1e3:8.3f} ms  floor {r['floor_s'] * 1e3:7.3f} ms "
                  f" kernel/floor {r['kernel_over_floor']:5.2f}  ({r['kernel_read_gbs']:5.1f} GB/s read)  "
                  f"torch reference {ref} ms", flush=True)
    return rows
