"""A gated DeltaNet mixer's shape (Qwen3-Next's linear-attention layers), as its family reads it
from the config (families/qwen3_next.py) and the decoder builds it (gated_deltanet.py). Plain data."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeltaNetConfig:
    """num_k_heads query/key heads of k_dim, num_v_heads value heads of v_dim (a multiple: each
    key head serves num_v_heads / num_k_heads value heads); the recurrent state is
    [num_v_heads, k_dim, v_dim] a sequence."""
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """What the causal convolution runs over: q, k and v."""
        return 2 * self.key_dim + self.value_dim
