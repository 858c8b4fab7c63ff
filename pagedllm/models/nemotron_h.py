"""Nemotron-H's decoder (families/nemotron_h.py): the shared decoder's embeddings, final norm and head
around layers of its own kind. Its checkpoint's blocks each hold one mixer behind a pre-norm; ours
group them, a layer being one Mamba-2 or attention block and the MLP blocks after it, so that every
layer keeps one kind of cache in the pool (a Mamba-2 state, or K/V) and an MLP block none. The
residual stream runs through the blocks as through any layer's halves: each block's output is added
to it by the next norm (ops.add_norm)."""
from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from .config import ModelConfig
from .decoder import DecoderForCausalLM
from .layers import Attention
from .mamba2 import Mamba2Mixer
from .norm import RMSNorm


class ReluSquaredMLP(nn.Module):
    """An MLP block: its norm, then down(relu(up(x))^2), no gate."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.linear(self.down_proj, torch.relu_(ops.linear(self.up_proj, x)).square_())


class NemotronHLayer(nn.Module):
    """A Mamba-2 or attention block (input_layernorm, then `mamba` or `self_attn`), then its
    cfg.trailing_mlps[index] MLP blocks (`mlps`)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = "mamba" if index in cfg.state_layers else "self_attn"
        setattr(self, self.mixer, Mamba2Mixer(cfg) if self.mixer == "mamba" else Attention(cfg, backend))
        self.mlps = nn.ModuleList(ReluSquaredMLP(cfg) for _ in range(cfg.trailing_mlps[index]))
        self.mlp = None   # no MLP of the shared layer's kind (nor a mixture: decoder.mixtures)

    def forward(self, x, residual, ops, rotate, k_cache, v_cache, meta, tp: TPGroup):
        """As layers.DecoderLayer: x the previous layer's output not yet added to the residual
        stream (the embeddings with residual None); returns (this layer's output, the stream)."""
        if residual is None:
            residual, x = x, ops.norm(x, self.input_layernorm)
        else:
            x, residual = ops.add_norm(x, residual, self.input_layernorm)
        x = getattr(self, self.mixer)(x, ops, rotate, k_cache, v_cache, meta)
        for block in self.mlps:
            x, residual = ops.add_norm(x, residual, block.norm)
            x = block(x, ops)
        return x, residual


class NemotronHForCausalLM(DecoderForCausalLM):
    layer = NemotronHLayer
