"""A decoder layer (attention, multi-head latent attention, or a hybrid model's state mixer; then the
MLP or a mixture of experts) with the options families pick (family.Family): q/k norms, per-layer windows, sandwich norms."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from .config import ModelConfig
from .mlp import MLP
from .moe import SparseMoE
from .norm import RMSNorm
from .ops import Ops
from .gated_deltanet import GatedDeltaNet
from .mamba2 import Mamba2Mixer
from .mla import LatentAttention
from .short_conv import ShortConv

# A state layer's mixer by ModelConfig.state_mixer: (its attribute, as checkpoints name it; its class)
MIXERS = {"short_conv": ("conv", ShortConv), "mamba2": ("mamba", Mamba2Mixer),
          "gated_deltanet": ("linear_attn", GatedDeltaNet)}


def state_mixer_matmuls(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """A state layer's mixer's matmuls, our names within the layer ("conv.in_proj"), as
    (in_features, out_features): read off the mixer built on the meta device (no memory), so
    that what adapters may target is what the layer holds."""
    if not cfg.state_mixer:
        return {}
    attr, cls = MIXERS[cfg.state_mixer]
    with torch.device("meta"):
        mixer = cls(cfg)
    return {f"{attr}.{name}": (m.in_features, m.out_features) for name, m in mixer.named_modules()
            if isinstance(m, nn.Linear)}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, window: int = 0) -> None:
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Qwen3-Next's output gate: q_proj gives each head its query and a gate of as many values
        self.gated = cfg.family.attn_output_gate
        q_rows = self.h * self.d * (2 if self.gated else 1)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_rows + 2 * self.kvh * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.sinks:   # one logit per head in every softmax (gpt-oss's attention sinks)
            self.register_buffer("sinks", torch.zeros(self.h))
        self.backend = backend
        self.scale = cfg.scale
        self.window = window  # this layer's sliding window (0: full attention)
        if cfg.family.qk_norm:  # over each head's d dims, before RoPE
            self.q_norm, self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps), RMSNorm(self.d, cfg.rms_norm_eps)
        elif cfg.family.qk_norm_whole:  # over all of q's heads at once (and k's), before RoPE
            self.q_norm = RMSNorm(self.h * self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kvh * self.d, cfg.rms_norm_eps)
        self.whole_norm = cfg.family.qk_norm_whole

    def forward(self, x, ops: Ops, rotate, k_cache, v_cache, meta: Any):
        t = x.shape[0]
        qkv = ops.linear(self.qkv_proj, x)
        q, k, v = qkv.split([self.qkv_proj.out_features - 2 * self.kvh * self.d, self.kvh * self.d,
                             self.kvh * self.d], dim=-1)
        if self.gated:   # each head's query, then its gate
            q, gate = q.view(t, self.h, 2 * self.d).split(self.d, dim=-1)
            q = q.reshape(t, self.h * self.d)
        if self.whole_norm:
            q, k = ops.norm(q.contiguous(), self.q_norm), ops.norm(k.contiguous(), self.k_norm)
        q, k = q.view(t, self.h, self.d), k.view(t, self.kvh, self.d)
        if hasattr(self, "q_norm") and not self.whole_norm:
            q, k = ops.head_norm(q, self.q_norm), ops.head_norm(k, self.k_norm)
        q, k = rotate(q, k)
        o = self.backend.forward(q, k, v.view(t, self.kvh, self.d), k_cache, v_cache, meta, self.scale,
                                 window=self.window, **({"sinks": self.sinks} if hasattr(self, "sinks") else {}))
        o = o.reshape(t, self.h * self.d)
        if self.gated:
            o = o * torch.sigmoid(gate.reshape(t, self.h * self.d))
        return ops.linear(self.o_proj, o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The token mixer: attention, or a layer that keeps a recurrent state (cfg.state_layers)
        self.mixer = MIXERS[cfg.state_mixer][0] if index in cfg.state_layers else "self_attn"
        if index in cfg.state_layers:
            setattr(self, self.mixer, MIXERS[cfg.state_mixer][1](cfg))
        elif cfg.mla is not None:
            self.self_attn = LatentAttention(cfg, backend)
        else:
            self.self_attn = Attention(cfg, backend, cfg.window(index))
        self.residual_multiplier = cfg.residual_multiplier
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the MLP's input norm
        self.mlp = SparseMoE(cfg) if cfg.moe is not None and cfg.moe.is_sparse(index) else MLP(cfg)
        if cfg.family.sandwich_norms:  # each sublayer's output is normed before the residual add
            self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.family.sandwich_norms

    def forward(self, x, residual, ops: Ops, rotate, k_cache, v_cache, meta, tp: TPGroup):
        """x: the previous layer's output (not yet added to the residual stream), or the
        embeddings with residual None. Returns (this layer's output, residual stream).
        Under tensor parallelism o_proj and down_proj are row-parallel: each rank holds a
        partial sum of their output, made whole by one all-reduce each."""
        if residual is None:
            residual, x = x, ops.norm(x, self.input_layernorm)
        else:
            x, residual = ops.add_norm(x, residual, self.input_layernorm)
        x = tp.all_reduce(getattr(self, self.mixer)(x, ops, rotate, k_cache, v_cache, meta))
        if self.sandwich:
            x = ops.norm(x, self.attn_output_norm)
        if self.residual_multiplier != 1.0:   # x: this layer's own output, scaled in place
            x = x.mul_(self.residual_multiplier)
        x, residual = ops.add_norm(x, residual, self.post_attention_layernorm)
        x = tp.all_reduce(self.mlp(x, ops))
        if self.residual_multiplier != 1.0:
            x = x.mul_(self.residual_multiplier)
        return (ops.norm(x, self.mlp_output_norm) if self.sandwich else x), residual
