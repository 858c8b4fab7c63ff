"""A Mamba-2 mixer's shape, as a family reads it from its config (families/) and the decoder
builds it (mamba2.py). Plain data: config.py and the family rows both import it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-2 mixer (mamba2.py): in_proj gives the gate z, x B C (through a causal convolution
    of ModelConfig.conv_kernel taps and SiLU) and dt per head; a selective scan of num_heads heads
    of head_dim, B and C of state_size shared by each of `groups` groups of heads; a gated RMSNorm
    over norm_groups groups of channels."""
    num_heads: int
    head_dim: int
    groups: int
    state_size: int
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    norm_groups: int = 1   # the gated RMSNorm's groups of channels, each normed alone (Nemotron-H: `groups`)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state_size
