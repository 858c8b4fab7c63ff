"""The CPU attention backend: a compiled kernel (kernels/csrc/attention.cpp) that walks the
block tables in place, decodes and prefill chunks in one call per layer.

Its pools are laid out per block and KV head (P = 2 for 16-bit types, 1 for fp32):
K [KVH, D/P, block_size, P] and V [KVH, ceil(block_size/P), D, P]. A block's keys for
one head are contiguous along each (pair of) dimensions, so the kernel scores 16 keys
per vector instruction without transposing anything, and with bf16 on AVX512_BF16 one
dot-product instruction does 32 multiply-adds of Q.K or P.V.

Multi-head latent attention (models/mla.py) keeps one latent head of [c, k_pe] rows a token, as the
torch backend lays it out ([num_blocks, B, 1, D], no V rows): decodes run on a compiled kernel
(kernels/csrc/latent_attention.cpp: every head of a sequence reads each key once, in place), short
prefill chunks on torch's matmuls (attention/torch_ref.py's latent_prefill), where many query rows
share each key anyway; long ones the model runs on expanded heads itself (latent_chunks).

Quantized pools (--kv-cache-dtype int8, fp8_e4m3, fp8_e5m2, int4) are uint8
[num_blocks, KVH, B * (D * bits / 8 + 2)]: per block and head, K's codes in 32-bit lanes
of one key (16 keys x 4 dims per 64-byte line), or V's codes a key per row, then a bf16
scale per key (kernels/csrc/kv_quant.h). The kernel reads codes where they lie and
decodes them in registers, 16 at a time; the scales multiply finished dot products (K)
or the softmax weights (V).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import load_ops
from ..kernels.chooser import Route
from ..kernels.cpu import compiled_head_dims
from ..util import cdiv
from .backend import AttentionBackend, StepLayout, register
from .fresh_prefill import fresh_route, sdpa_chunk
from .torch_ref import latent_decode, latent_prefill, latent_rows, write_rows


@dataclass
class CpuMetadata:
    """The whole step in one call: every sequence in row order (decodes, then prefills)."""
    slot_mapping: torch.Tensor     # [T] slot of each new token's K/V (-1: padding row)
    block_tables: torch.Tensor     # [S, W] int32, zero-padded
    seq_lens: torch.Tensor         # [S] int32: keys after this step
    query_start_loc: torch.Tensor  # [S + 1] int32: first query row of each sequence
    # The trailing sequences whose chunk has no keys before it, as (sequence, first row, rows):
    # fresh_prefill.py may run them on torch's flash attention (the runner orders them last).
    fresh: list[tuple[int, int, int]] = field(default_factory=list)
    rows: int = 0                  # real query rows (padding rows after them)
    num_decodes: int = 0           # the leading sequences of one query row each
    host_starts: list[int] = field(default_factory=list)   # query_start_loc and seq_lens as lists
    host_lens: list[int] = field(default_factory=list)
    latent_rows: torch.Tensor | None = None   # rows whose latent a step writes: set by the first MLA layer
    sdpa: list[tuple[int, int, int]] | None = None   # of `fresh`, those flash attention runs: set by the first layer
    prefills: list[tuple[int, int, int, int]] | None = None   # latent_chunks': set by the first MLA layer


@register
class CpuPagedAttention(AttentionBackend):
    name = "cpu"
    sinks = True
    latent = True
    kv_dtypes = ("int8", "fp8_e4m3", "fp8_e5m2", "int4")

    def __init__(self) -> None:
        try:
            self.ops = load_ops()
        except RuntimeError as e:
            raise ImportError(str(e)) from e
        # Split long decodes across threads when the step has too few items for them.
        # Batch-invariant mode turns it off: merging the parts sums in another order than
        # one pass over the keys, so a row's result would depend on what else is decoding.
        self.split_k = True
        # The split is planned for this many threads (the engine's configured count; 0: however
        # many run), not for the count of the moment: when the thread governor drops a thread
        # under load, a request's sums keep their order and its greedy text its tokens.
        self.plan_threads = 0
        # Fresh prefill chunks on torch's flash attention where the chooser times it faster
        # (fresh_prefill.py); off in batch-invariant mode (one path for every chunk).
        self.fresh_prefill = True
        self._routes: dict[tuple, Route] = {}

    @classmethod
    def check_model(cls, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                    sinks: bool = False) -> None:
        super().check_model(num_heads, num_kv_heads, head_dim, v_head_dim, sinks)
        if v_head_dim == 0:   # a latent pool: its own kernel, any width of 16s
            if head_dim % 16:
                raise ValueError(f"attention backend cpu runs latent rows of a multiple of 16 values, not {head_dim}; "
                                 "use --attention-backend torch")
            return
        dims = compiled_head_dims()
        if head_dim not in dims:
            raise ValueError(f"attention backend cpu supports head_dim in {dims}, not {head_dim}; "
                             "use --attention-backend torch")

    def cache_shapes(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     v_head_dim: int | None = None):
        if v_head_dim == 0:   # a latent pool, laid out as the torch backend's (the kernel reads its rows)
            return super().cache_shapes(num_blocks, block_size, kv_heads, head_dim, dtype, v_head_dim)
        if self.kv is not None:
            v_row = block_size * self.kv.v_head_bytes(head_dim)
            if self.kv.name in ("int8", "int4"):  # V in pairs of keys: an odd block pads one key's codes
                v_row += (block_size % 2) * head_dim * self.kv.bits // 8
            return (num_blocks, kv_heads, block_size * self.kv.k_head_bytes(head_dim)), (num_blocks, kv_heads, v_row)
        p = 2 if dtype.itemsize == 2 else 1
        return ((num_blocks, kv_heads, head_dim // p, block_size, p),
                (num_blocks, kv_heads, cdiv(block_size, p), head_dim, p))

    def build_metadata(self, layout: StepLayout, device) -> CpuMetadata:
        i32 = dict(dtype=torch.int32, device=device)
        starts, lens = layout.query_starts, layout.seq_lens
        fresh = []
        for s in range(len(lens) - 1, layout.num_decodes - 1, -1):   # the trailing chunks with no keys before
            n = starts[s + 1] - starts[s]
            if n < 2 or lens[s] != n:
                break
            fresh.append((s, starts[s], n))
        return CpuMetadata(torch.tensor(layout.slots, dtype=torch.long, device=device), layout.padded_tables(device),
                           torch.tensor(lens, **i32), torch.tensor(starts, **i32), fresh[::-1], starts[-1],
                           layout.num_decodes, starts, lens)

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMetadata, scale: float, window: int = 0, sinks=None):
        fmt = self.kv.fmt if self.kv is not None else 0
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, fmt)
        out = torch.empty_like(q)
        apart = self._on_sdpa(meta, q, k, window) if sinks is None else []   # torch's flash attention has no sinks
        n, rows = (apart[0][0], apart[0][1]) if apart else (len(meta.seq_lens), q.shape[0])
        if n:
            self.ops.paged_attention(out[:rows], q[:rows], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n],
                                     meta.query_start_loc[:n + 1], scale, self.split_k, fmt, window, self.plan_threads,
                                     sinks)
        for _, a, m in apart:
            out[a:a + m] = sdpa_chunk(q[a:a + m], k[a:a + m], v[a:a + m], scale)
        if apart:
            out[meta.rows:].zero_()   # padding rows, as the kernel leaves them
        return out

    def forward_latent(self, q, latent, cache, meta: CpuMetadata, scale: float, v_dim: int):
        if self.kv is not None:
            raise ValueError("multi-head latent attention keeps its latent unquantized (kv_cache_dtype auto)")
        if meta.latent_rows is None:   # once a step: a row whose key a prefix hit holds (slot -1) writes nothing
            meta.latent_rows = (meta.slot_mapping[:meta.rows] >= 0).nonzero().squeeze(1)
        rows = meta.latent_rows
        write_rows(latent[rows], cache, meta.slot_mapping[rows])
        out = q.new_empty(*q.shape[:2], v_dim)
        out[meta.rows:].zero_()   # padding rows, as forward leaves them
        nd, starts, lens = meta.num_decodes, meta.host_starts, meta.host_lens
        if nd and v_dim % 16:   # the kernel's vectors: 16 values (DeepSeek's latents are 512)
            out[:nd] = latent_decode(q[:nd], cache, meta.block_tables[:nd], meta.seq_lens[:nd], max(lens[:nd]),
                                     scale, v_dim)
        elif nd:
            self.ops.latent_decode(out[:nd], q[:nd], cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        for s in range(nd, len(lens)):
            a, b = starts[s], starts[s + 1]
            if a >= q.shape[0]:   # the chunks the model ran on expanded heads (latent_chunks)
                break
            out[a:b] = latent_prefill(q[a:b], cache, meta.block_tables[s], lens[s], scale, v_dim)
        return out

    def latent_chunks(self, meta: CpuMetadata) -> list[tuple[int, int, int, int]]:
        # None in batch-invariant mode: how a prompt is chunked depends on the step's budget, so
        # which form a chunk took would too
        if not self.fresh_prefill:
            return []
        if meta.prefills is None:   # once a step: every layer asks
            starts, lens = meta.host_starts, meta.host_lens
            meta.prefills = [(s, starts[s], starts[s + 1] - starts[s], lens[s])
                             for s in range(meta.num_decodes, len(lens))]
        return meta.prefills

    def latent_keys(self, cache: torch.Tensor, meta: CpuMetadata, seq: int, n: int) -> torch.Tensor:
        return latent_rows(cache, meta.block_tables[seq], n)

    def fresh_route(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Route:
        """Which fresh chunk lengths run on flash attention for this head shape (timed once, by the
        chooser; the runner asks at start-up so that no request's step waits on the timing)."""
        key = (heads, kv_heads, head_dim, dtype)
        if key not in self._routes:
            self._routes[key] = fresh_route(self.ops, self, *key)
        return self._routes[key]

    def _on_sdpa(self, meta: CpuMetadata, q, k, window: int) -> list[tuple[int, int, int]]:
        """The trailing fresh chunks torch's flash attention runs faster (fresh_prefill.py): those
        whose length the chooser's route gives to it, from the last back to the first that it does
        not; none with a window, quantized blocks (the kernel reads their codes back) or in
        batch-invariant mode."""
        if not meta.fresh or not self.fresh_prefill or window or self.kv is not None:
            return []
        if meta.sdpa is None:   # once a step: every layer of the metadata has the same heads and chunks
            route, apart = self.fresh_route(q.shape[1], k.shape[1], q.shape[2], q.dtype), []
            for chunk in reversed(meta.fresh):
                if route.pick(chunk[2]) != "sdpa":
                    break
                apart.append(chunk)
            meta.sdpa = apart[::-1]
        return meta.sdpa
