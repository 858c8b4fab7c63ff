"""The Triton paged-attention kernels against the torch reference backend.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1) on small shapes; with a
GPU (or PAGEDLLM_GPU_SHAPES=1) the same cases run at larger shapes. Skipped, with the
reason, where Triton is not installed."""
from __future__ import annotations

import os
import random

import pytest
import torch

from pagedllm.attention import StepLayout, triton_available
from pagedllm.attention.kv_quant import FP8, quantize
from pagedllm.attention.torch_ref import TorchPagedAttention
from pagedllm.kv_dtype import KV_DTYPES

if triton_available() is not None:
    pytest.skip(f"Triton kernels not tested: {triton_available()}", allow_module_level=True)

from pagedllm.attention import triton_kernels as tk  # noqa: E402
from pagedllm.attention.triton_backend import TritonPagedAttention  # noqa: E402

tl = tk.tl  # triton.language, imported once the interpreter is set (triton_kernels sets it)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BIG = CUDA or os.environ.get("PAGEDLLM_GPU_SHAPES") == "1"
# (heads, kv heads, head dim): GQA 4:1, MHA, and a head dim that is not a power of two.
SHAPES = [(8, 2, 64), (4, 4, 32), (6, 2, 48)] if BIG else [(4, 2, 16), (2, 2, 32), (6, 2, 24)]
MAX_CTX = 3000 if BIG else 90


def make_batch(rng: random.Random, block_size: int, kvh: int, d: int, decode_lens: list[int],
               prefill: list[tuple[int, int]], dtype=torch.float32, kv: str | None = None):
    """A random pool and block tables for decodes (context lengths) and prefills
    (cached prefix length, new query tokens); physical blocks shuffled across sequences.
    kv: a quantized kind: the pool holds random values' quantized rows (keys 3x larger)."""
    need = [-(-n // block_size) for n in decode_lens] + [-(-(c + q) // block_size) for c, q in prefill]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn((num_blocks, block_size, kvh, d), generator=g).to(DEV, dtype)
    v_cache = torch.randn((num_blocks, block_size, kvh, d), generator=g).to(DEV, dtype)
    if kv:
        k_cache, v_cache = quantize(k_cache * 3, KV_DTYPES[kv], key=True), quantize(v_cache, KV_DTYPES[kv])
    return k_cache, v_cache, tables


def build_layout(block_size: int, tables: list[list[int]], decode_lens: list[int], prefill: list[tuple[int, int]]):
    """The step as the runner lays it out (decodes first), and its query row count."""
    slots, starts, lens, used = [], [0], [], []
    nd = len(decode_lens)
    for i, n in enumerate(decode_lens):
        slots.append(tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size)
        starts.append(starts[-1] + 1)
        lens.append(n)
        used.append(tables[i][:-(-n // block_size)])
    for j, (cached, ql) in enumerate(prefill):
        t = tables[nd + j]
        end = cached + ql
        slots += [t[p // block_size] * block_size + p % block_size for p in range(cached, end)]
        starts.append(starts[-1] + ql)
        lens.append(end)
        used.append(t[:-(-end // block_size)])
    return StepLayout(slots, used, lens, starts, nd), starts[-1]


def release_below_window(layout: StepLayout, k_cache, v_cache, block_size: int, window: int, firsts: list[int]) -> None:
    """What the KV manager does under a sliding window: each table's entries wholly below
    its first query's window become -1, and their blocks are overwritten with huge values
    (read once, they would swamp the result)."""
    for table, first in zip(layout.block_tables, firsts):
        for i in range(max(0, first - window + 1) // block_size):
            k_cache[table[i]], v_cache[table[i]] = (255, 255) if k_cache.dtype == torch.uint8 else (1e4, 1e4)
            table[i] = -1


def run_both(seed: int, block_size: int, shape, decode_lens, prefill, dtype=torch.float32, atol=2e-4, window=0,
             kv: str | None = None):
    """The Triton backend's step against the torch reference's, on copies of one pool
    (kv: both storing that quantized kind)."""
    h, kvh, d = shape
    rng = random.Random(seed)
    k_cache, v_cache, tables = make_batch(rng, block_size, kvh, d, decode_lens, prefill, dtype, kv)
    layout, t = build_layout(block_size, tables, decode_lens, prefill)
    if window:
        release_below_window(layout, k_cache, v_cache, block_size, window,
                             [n - 1 for n in decode_lens] + [c for c, _ in prefill])
    ref_backend, triton = TorchPagedAttention(), TritonPagedAttention()
    if kv:
        ref_backend.use_kv_dtype(KV_DTYPES[kv])
        triton.use_kv_dtype(KV_DTYPES[kv])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((t, h, d), generator=g).to(DEV, dtype)
    k = torch.randn((t, kvh, d), generator=g).to(DEV, dtype)
    v = torch.randn((t, kvh, d), generator=g).to(DEV, dtype)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ref = ref_backend.forward(q, k, v, k_cache, v_cache, ref_backend.build_metadata(layout, DEV), d ** -0.5,
                              window=window)
    out = triton.forward(q, k, v, kc2, vc2, triton.build_metadata(layout, DEV), d ** -0.5, window=window)
    assert torch.equal(kc2, k_cache) and torch.equal(vc2, v_cache), "reshape_and_cache wrote different slots"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_mixed_lengths(block_size, shape):
    rng = random.Random(block_size * 31 + shape[2])
    lens = [1, 2, block_size, block_size + 1] + [rng.randint(1, MAX_CTX) for _ in range(4)]
    run_both(1, block_size, shape, lens, [])


def test_decode_long_context_splits_into_partitions():
    """Contexts over one partition (512 tokens) are split and reduced."""
    lens = [tk.PARTITION + 7, 2 * tk.PARTITION + 100, 3] if not BIG else [4096, 2049, 511, 513]
    run_both(2, 16, SHAPES[0], lens, [])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_over_cached_prefix(block_size, shape):
    """Fresh prompts, chunks after a cached prefix (full and partial blocks), one-token chunks."""
    prefill = [(0, 37), (2 * block_size, 20), (block_size + 5, 1), (0, 1), (3, 70 if not BIG else 700)]
    run_both(3, block_size, shape, [], prefill)


def test_mixed_decode_and_prefill_batch():
    run_both(4, 16, SHAPES[0], [5, 40, 1], [(16, 9), (0, 33)])


def test_empty_batch_and_padding_rows():
    run_both(5, 16, SHAPES[0], [], [])
    # Padding rows as CUDA-graph buckets make them: slot -1 (nothing written), context 0 (output 0).
    h, kvh, d = SHAPES[0]
    k_cache = torch.zeros((4, 16, kvh, d), device=DEV)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones((2, kvh, d), device=DEV)
    tk.reshape_and_cache(k, k, k_cache, v_cache, torch.tensor([5, -1], device=DEV))
    assert k_cache.view(-1, kvh, d)[5].eq(1).all() and k_cache.sum() == kvh * d
    q = torch.randn((2, h, d), device=DEV)
    out = tk.paged_decode(q, k_cache, v_cache, torch.tensor([[0], [0]], device=DEV),
                          torch.tensor([6, 0], device=DEV), 0.1, max_context=2048)
    assert torch.isfinite(out).all() and out[1].eq(0).all()
    # A graph-sized bound (128k) makes longer partitions, not hundreds of them; same answer.
    big = tk.paged_decode(q, k_cache, v_cache, torch.tensor([[0], [0]], device=DEV),
                          torch.tensor([6, 0], device=DEV), 0.1, max_context=131072)
    torch.testing.assert_close(big, out)


@pytest.mark.parametrize("window", [1, 20, 70])
def test_sliding_window_skips_released_blocks(window):
    """A windowed layer: decodes (one split into partitions wholly below the window) and
    prefill chunks whose tiles start inside and below the window; the -1 entries the
    window released are never read."""
    decode = [1, 17, 60, tk.PARTITION + 40] if not BIG else [1, 17, 600, 3 * tk.PARTITION + 40]
    run_both(7, 16, SHAPES[2], decode, [(0, 37), (45, 20), (70, 1), (3, 50)], window=window)


def test_bf16():
    """bf16 K/V and queries (tensor cores on a GPU; widened to fp32 dots in the interpreter,
    whose numpy dot has no bf16)."""
    if BIG:
        run_both(6, 16, SHAPES[0], [2048] * 8 + [17], [(512, 300)], dtype=torch.bfloat16, atol=2e-2)
    else:
        run_both(6, 16, SHAPES[0], [MAX_CTX, 40, 17, 1], [(20, 45)], dtype=torch.bfloat16, atol=2e-2)


@tk.triton.jit
def _widen_fp8(codes_ptr, out_ptr, FP8: tl.constexpr):
    c = tl.load(codes_ptr + tl.arange(0, 256))
    tl.store(out_ptr + tl.arange(0, 256), tk._fp8_as_fp16(c, FP8).to(tl.float32) * tk._fp8_unit(FP8))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # e5m2's NaN x 1, in numpy
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_widen_exactly(kind):
    """Every fp8 code, widened by the kernels' bit moves (sm_80 has no e4m3 type), is the
    value torch gives it: subnormals and signed zeros included (e4m3's NaN code aside: the
    quantizer clamps to the finite range; e5m2's inf and NaN come through as fp16's)."""
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    got = torch.empty(256, device=DEV)
    _widen_fp8[(1,)](codes, got, FP8=tk.FP8_KINDS[kind])
    want = codes.view(FP8[kind]).float()
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite]) and torch.equal(got[finite].signbit(), want[finite].signbit())
    assert (~finite).sum() == (2 if kind == "fp8_e4m3" else 8)
    if kind == "fp8_e5m2":
        assert torch.equal(got[~finite].isinf(), want[~finite].isinf()) and got[~finite].isnan().sum() == 6


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_read_in_place(kind):
    """fp8 pools (torch layout: codes, then the bf16 scale) read in place: decodes and
    prefills over cached prefixes, GQA 3:1 at a head dim that is not a power of two (the
    row's scale sits past D, inside the padded tile), a window with released blocks (0xff:
    NaN if read), bf16 (e4m3) and fp16 (e5m2) queries; the pools written byte for byte as
    the torch backend's."""
    run_both(8, 16, SHAPES[0], [5, 40, 1], [(16, 9), (0, 33)], kv=kind)
    run_both(9, 16, SHAPES[2], [1, 17, 60], [(45, 20), (3, 50)], window=20, kv=kind)
    half = torch.bfloat16 if kind == "fp8_e4m3" else torch.float16
    run_both(10, 16, SHAPES[0], [MAX_CTX, 17], [(20, 45)], dtype=half, atol=2e-2, kv=kind)
