"""The attention-backend interface: attention whose K/V live in paged pools."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    q_start: int            # first row of this sequence's queries in the flat batch
    q_len: int
    ctx_len: int            # tokens it attends to: cached prefix + this chunk
    block_table: torch.Tensor  # [ceil(ctx_len / B)] physical block ids


@dataclass
class AttentionMetadata:
    """One step's batch, decodes first: rows [0, num_decodes) are single-token queries."""
    slot_mapping: torch.Tensor      # [num_tokens] slot of each new token's K/V
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    decode_max_context: int
    prefills: list[PrefillSeq]
    # Decode rows are sorted by context length; these (start, end, max context) groups
    # let a backend pad each group only to its own longest context.
    decode_groups: list[tuple[int, int, int]] = field(default_factory=list)
    # Every sequence of the step in row order (decodes, then prefills), for backends that
    # take the whole step at once: block tables [S, W] int32 (zero-padded), keys after
    # this step [S] int32, first query row [S + 1] int32.
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    # A backend's own derived tensors for this step, built by the first layer, reused by the rest.
    backend_state: dict = field(default_factory=dict)


def length_groups(sorted_lens: list[int], size: int) -> list[tuple[int, int, int]]:
    """(start, end, max length) for consecutive groups of `size` ascending lengths."""
    return [(i, min(i + size, len(sorted_lens)), sorted_lens[min(i + size, len(sorted_lens)) - 1])
            for i in range(0, len(sorted_lens), size)]


def pad_rows(rows: list[list[int]], device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Block tables of different lengths as one [len(rows), longest] tensor, zero-padded."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype, device=device)


class AttentionBackend(ABC):
    name: str

    @staticmethod
    def check_model(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError if this backend cannot run a model with these heads."""

    @staticmethod
    def cache_shapes(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's K and V pools; a block is always the first dimension."""
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return shape, shape

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the new tokens; caches [num_blocks, B, KVH, D].
        Writes k/v into their slots, then attends through the block tables. Returns [T, H, D]."""


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def get_backend(name: str) -> AttentionBackend:
    if name == "triton" and "triton" not in _REGISTRY:
        from .triton_backend import triton_available
        raise ValueError(f"attention backend triton cannot run here: {triton_available()}")
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
