"""The CUDA attention backend: Triton kernels that read K/V in place through the block
tables (see triton_kernels). Chosen automatically on CUDA when Triton imports.

fp8 KV (--kv-cache-dtype fp8 / fp8_e5m2) is read in place too: new rows are quantized as
kv_quant does (rotated by the Hadamard matrix H), so the query is rotated before the
kernels and their output rotated back after (H H = I)."""
from __future__ import annotations

import torch

from dataclasses import dataclass

from .backend import AttentionBackend, SplitMetadata, StepLayout, register, register_unavailable
from .kv_quant import rotate


@dataclass
class TritonMetadata(SplitMetadata):
    # The prefill chunks' descriptors as device tensors (tables, q_starts, q_lens,
    # ctx_lens, tiles), or None in a decode-only step.
    prefill_tensors: dict | None = None


def triton_available() -> str | None:
    """None if the Triton backend can run here, else why not."""
    import importlib.util
    # find_spec, not import: importing Triton costs every start-up half a second.
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    supports_decode_graphs = True
    kv_dtypes = ("fp8_e4m3", "fp8_e5m2")

    def __init__(self) -> None:
        from . import triton_kernels  # imported here: it sets TRITON_INTERPRET on CPU machines
        self.k = triton_kernels

    def build_metadata(self, layout: StepLayout, device) -> TritonMetadata:
        meta = TritonMetadata.from_layout(layout, device)
        if meta.prefills:
            meta.prefill_tensors = self.prefill_tensors(meta, device)
        return meta

    def decode_graph_metadata(self, slots, block_tables, context_lens, max_context: int) -> TritonMetadata:
        return TritonMetadata(slot_mapping=slots, num_decodes=slots.shape[0], decode_block_tables=block_tables,
                              decode_context_lens=context_lens, decode_max_context=max_context, prefills=[])

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float, window: int = 0):
        kern, kv = self.k, self.kv
        kern.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv)
        q = q.contiguous() if kv is None else rotate(q).to(q.dtype)  # q H . k H = q . k
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            kern.paged_decode(q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                              scale, meta.decode_max_context, out=out[:n], window=window, kv=kv)
        if meta.prefills:
            t = meta.prefill_tensors or self.prefill_tensors(meta, q.device)
            kern.paged_prefill(q, k_cache, v_cache, out, t["tables"], t["q_starts"], t["q_lens"],
                               t["ctx_lens"], t["tiles"], scale, window, kv)
        return out if kv is None else rotate(out).to(q.dtype)  # sum p v H, rotated back

    def prefill_tensors(self, meta: SplitMetadata, device) -> dict:
        """The step's prefill descriptors as device tensors, built once per step."""
        ps = meta.prefills
        width = max(p.block_table.numel() for p in ps)
        tables = torch.zeros((len(ps), width), dtype=torch.int32, device=device)
        for i, p in enumerate(ps):
            tables[i, :p.block_table.numel()] = p.block_table
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        return {"tables": tables, "q_starts": as_t([p.q_start for p in ps]), "q_lens": as_t([p.q_len for p in ps]),
                "ctx_lens": as_t([p.ctx_len for p in ps]), "tiles": self.k.prefill_tiles([p.q_len for p in ps], device)}


if triton_available() is None:
    register(TritonPagedAttention)
else:
    register_unavailable("triton", triton_available())
