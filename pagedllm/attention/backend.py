"""The attention-backend interface: attention whose K/V live in paged pools."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..kv_dtype import KV_DTYPES, KVDtype


@dataclass
class StepLayout:
    """One step as every backend sees it before building its own metadata: sequences in
    row order, decodes (single-token queries, shortest context first) before prefills."""
    slots: list[int]                 # per query row: where its K/V goes (-1: nowhere; a padding row,
                                     # or a row whose KV a prefix hit already holds)
    block_tables: list[list[int]]    # per sequence: its physical blocks, up to its last token; -1
                                     # (RELEASED) for blocks below the sliding window of all its queries
    seq_lens: list[int]              # per sequence: keys it attends to, this step's included
    query_starts: list[int]          # first query row of each sequence, then the row count
    num_decodes: int

    def padded_tables(self, device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """[S, longest table] zero-padded."""
        return pad_rows(self.block_tables, device, dtype)


@dataclass
class PrefillSeq:
    q_start: int            # first row of this sequence's queries in the flat batch
    q_len: int
    ctx_len: int            # tokens it attends to: cached prefix + this chunk
    block_table: torch.Tensor  # [ceil(ctx_len / B)] physical block ids


@dataclass
class SplitMetadata:
    """Decodes and prefills apart (the torch and Triton backends): rows [0, num_decodes)
    are single-token queries over padded tables; each prefill chunk comes with its own."""
    slot_mapping: torch.Tensor      # [num_tokens] slot of each new token's K/V
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    decode_max_context: int
    prefills: list[PrefillSeq]

    @classmethod
    def from_layout(cls, layout: StepLayout, device, **extra) -> SplitMetadata:
        nd, q0 = layout.num_decodes, layout.query_starts
        tables = layout.padded_tables(device)
        lens = layout.seq_lens
        return cls(slot_mapping=torch.tensor(layout.slots, dtype=torch.long, device=device), num_decodes=nd,
                   decode_block_tables=tables[:nd] if nd else None,
                   decode_context_lens=torch.tensor(lens[:nd], device=device) if nd else None,
                   decode_max_context=max(lens[:nd], default=0),
                   prefills=[PrefillSeq(q0[i], q0[i + 1] - q0[i], lens[i], tables[i, :len(layout.block_tables[i])])
                             for i in range(nd, len(lens))], **extra)


def pad_rows(rows: list[list[int]], device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Block tables of different lengths as one [len(rows), longest] tensor, zero-padded."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype, device=device)


class AttentionBackend(ABC):
    name: str
    # Whether decode steps can be captured as CUDA graphs (decode_graph_metadata works).
    supports_decode_graphs: bool = False
    # The quantized KV kinds (kv_dtype names) this backend reads in place; and the pool's
    # kind, once the runner has chosen one (None: K/V stored as the model computes them).
    kv_dtypes: tuple[str, ...] = ()
    kv: KVDtype | None = None

    def use_kv_dtype(self, kv: KVDtype) -> None:
        """Store K/V as `kv` from now on; ValueError if this backend cannot read it."""
        if kv.quantized and kv.name not in self.kv_dtypes:
            can = f"it reads {', '.join(self.kv_dtypes)}" if self.kv_dtypes else "it reads no quantized kind"
            raise ValueError(f"attention backend {self.name} cannot read kv_cache_dtype {kv.name} ({can}); "
                             "the cpu backend reads them all")
        self.kv = kv if kv.quantized else None

    def kv_dtype_of(self, dtype: torch.dtype) -> KVDtype:
        """How a pool of this backend stores K/V computed in `dtype`."""
        return self.kv or KV_DTYPES[str(dtype).removeprefix("torch.")]

    def pool_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The pool tensors' element type: bytes when quantized."""
        return torch.uint8 if self.kv is not None else dtype

    # Whether it runs multi-head latent attention (forward_latent: values read from the keys' rows).
    latent: bool = False
    # Whether forward takes attention sinks (a logit per head in every softmax: gpt-oss).
    sinks: bool = False

    @classmethod
    def check_model(cls, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                    sinks: bool = False) -> None:
        """Raise ValueError if this backend cannot run a model with these heads (v_head_dim: the
        V rows' width where it is not head_dim; 0 under multi-head latent attention; sinks: the
        model's attention has sink logits)."""
        if v_head_dim is not None and v_head_dim != head_dim and not cls.latent:
            raise ValueError(f"attention backend {cls.name} does not run multi-head latent attention (K rows of "
                             f"{head_dim}, values read from them); the cpu and torch backends do")
        if sinks and not cls.sinks:
            raise ValueError(f"attention backend {cls.name} does not run attention sinks (gpt-oss); "
                             "the torch and cpu backends do")

    def cache_shapes(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, v_head_dim: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's K and V pools (of pool_dtype(dtype)); a block is always the
        first dimension. Quantized: each token's head as its codes, then its scale bytes.
        v_head_dim: the V rows' width where it differs (0: no V rows, multi-head latent attention)."""
        if self.kv is None:
            v = head_dim if v_head_dim is None else v_head_dim
            return (num_blocks, block_size, kv_heads, head_dim), (num_blocks, block_size, kv_heads, v)
        return ((num_blocks, block_size, kv_heads, self.kv.k_head_bytes(head_dim)),
                (num_blocks, block_size, kv_heads, self.kv.v_head_bytes(head_dim)))

    @abstractmethod
    def build_metadata(self, layout: StepLayout, device: torch.device | str) -> Any:
        """This backend's tensors for the step, built once and read by every layer."""

    def decode_graph_metadata(self, slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                              max_context: int) -> Any:
        """Metadata over a CUDA graph's static decode buffers (padding rows: slot -1,
        context 0), valid for any context up to max_context."""
        raise NotImplementedError(f"attention backend {self.name} has no CUDA-graph decode")

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, meta: Any, scale: float,
                       v_dim: int) -> torch.Tensor:
        """Multi-head latent attention (models/mla.py): latent [T, 1, D] the new tokens' rows, all
        written into `cache` (K's pool) at their slots; q [R, H, D] absorbed queries of the step's
        first R rows (R < T where the model runs the chunks after them on expanded heads itself,
        latent_chunks): every head attends to the one latent head, each key's first v_dim dims its
        value. Returns [R, H, v_dim]."""
        raise NotImplementedError(f"attention backend {self.name} does not run multi-head latent attention")

    def latent_chunks(self, meta: Any) -> list[tuple[int, int, int, int]]:
        """The step's prefill chunks (every sequence after the decodes) as (sequence, first row,
        rows, keys after the step), of which multi-head latent attention may run a trailing run on
        expanded heads (models/mla.py); none here: every row in latent space."""
        return []

    def latent_keys(self, cache: torch.Tensor, meta: Any, seq: int, n: int) -> torch.Tensor:
        """[n, D]: a sequence's first n latent rows, from the pool."""
        raise NotImplementedError(f"attention backend {self.name} does not read latent rows back")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any, scale: float,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the new tokens; caches per cache_shapes.
        Writes k/v into their slots, then attends through the block tables. Returns [T, H, D].

        window: the layer's sliding window W (0: full attention). A query at absolute
        position p sees keys j with p - W < j <= p (HF's `kv_idx > q_idx - sliding_window`).
        Table entries below the window of a sequence's first query may be -1: they must
        never be dereferenced (a block the KV manager released).

        sinks: [H] logits, one a head, that join each query's softmax beside its keys and attend to
        nothing (gpt-oss); only a backend whose `sinks` is set takes them."""


# The factory registry: each backend module registers its class at import, or the
# reason it cannot run here (so asking for it says why instead of "unknown").
_REGISTRY: dict[str, type[AttentionBackend]] = {}
_UNAVAILABLE: dict[str, str] = {}


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def register_unavailable(name: str, reason: str) -> None:
    _UNAVAILABLE[name] = reason


def get_backend(name: str) -> AttentionBackend:
    if name in _UNAVAILABLE:
        raise ValueError(f"attention backend {name} cannot run here: {_UNAVAILABLE[name]}")
    if name not in _REGISTRY:
        raise ValueError(f"attention backend must be one of {sorted(_REGISTRY)}, got {name!r}")
    try:
        return _REGISTRY[name]()
    except ImportError as e:
        raise ValueError(f"attention backend {name} cannot run here: {e}") from e


def pick_backend(name: str, device: str) -> str:
    """auto: Triton kernels on CUDA when Triton imports, the compiled kernel on CPU."""
    if name != "auto":
        return name
    if device == "cuda":
        return "triton" if "triton" in _REGISTRY else "torch"
    return "cpu"
