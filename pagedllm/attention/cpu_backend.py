"""The CPU attention backend: a compiled kernel (kernels/csrc/attention.cpp) that walks the
block tables in place, decodes and prefill chunks in one call per layer.

Its pools are laid out per block and KV head (P = 2 for 16-bit types, 1 for fp32):
K [KVH, D/P, block_size, P] and V [KVH, ceil(block_size/P), D, P]. A block's keys for
one head are contiguous along each (pair of) dimensions, so the kernel scores 16 keys
per vector instruction without transposing anything, and with bf16 on AVX512_BF16 one
dot-product instruction does 32 multiply-adds of Q.K or P.V.
"""
from __future__ import annotations

import torch

from .backend import AttentionBackend, AttentionMetadata, register
from ..kernels import load_ops

# Head dims the kernel is compiled for.
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


@register
class CpuPagedAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        try:
            self.ops = load_ops()
        except RuntimeError as e:
            raise ImportError(str(e)) from e
        # Split long decodes across threads when the step has too few items for them.
        # Batch-invariant mode turns it off: merging the parts sums in another order than
        # one pass over the keys, so a row's result would depend on what else is decoding.
        self.split_k = True

    @staticmethod
    def check_model(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"attention backend cpu supports head_dim in {HEAD_DIMS}, not {head_dim}; "
                             "use --attention-backend torch")

    @staticmethod
    def cache_shapes(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        p = 2 if dtype.itemsize == 2 else 1
        return ((num_blocks, kv_heads, head_dim // p, block_size, p),
                (num_blocks, kv_heads, -(-block_size // p), head_dim, p))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        self.ops.paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                 scale, self.split_k)
        return out
