"""Rotary position embedding, honouring rope_theta, partial rotary and the common scalings
(linear, Llama 3, YaRN, Phi-3's LongRoPE), with the values transformers computes."""
from __future__ import annotations

import math

import torch

from .config import ROPE_SCALINGS
from .rope_scaling import yarn_mscale


def _base_inv(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > low_wl, inv / factor, torch.where(wavelen < high_wl, inv, mid))


def _factor(s: dict) -> float:
    """YaRN's and LongRoPE's context factor: the config's, else max / original positions."""
    return s.get("factor") or s["max_position_embeddings"] / s["original_max_position_embeddings"]


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): dims that turn fewer than beta_slow times over the original
    context are interpolated by `factor`, those turning more than beta_fast times keep their
    frequency, a linear ramp between; cos and sin are scaled by the attention factor."""
    orig, factor = s["original_max_position_embeddings"], _factor(s)
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim index that turns `rotations` times over orig positions
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    inv = _base_inv(dim, theta)
    return inv / factor * ramp + inv * (1 - ramp), float(attn)


def _longrope_attention(s: dict) -> float:
    orig, factor = s["original_max_position_embeddings"], _factor(s)
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return float(attn)


def rope_angles(dim: int, max_positions: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """[max_positions, dim / 2] angles (float64) and the factor cos and sin are scaled by.
    LongRoPE: positions below original_max_position_embeddings turn by short_factor, those
    from it on by long_factor. transformers switches a whole forward pass by its length, so
    a sequence that grows past the original context has its earlier keys on the short
    factors here, as in transformers' own decoding with a cache (vLLM switches by batch)."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")
    pos = torch.arange(max_positions, dtype=torch.float64)
    if kind == "longrope":
        orig = scaling["original_max_position_embeddings"]
        base = _base_inv(dim, theta)
        short = base / torch.tensor(scaling["short_factor"], dtype=torch.float64)
        long = base / torch.tensor(scaling["long_factor"], dtype=torch.float64)
        inv = torch.where((pos < orig)[:, None], short, long)
        return pos[:, None] * inv, _longrope_attention(scaling)
    attn = 1.0
    if kind == "yarn":
        inv, attn = _yarn(dim, theta, scaling)
    else:
        inv = _base_inv(dim, theta)
        if kind == "linear":
            inv = inv / scaling["factor"]
        elif kind == "llama3":
            inv = _llama3(inv, scaling)
    return torch.outer(pos, inv), attn


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin per position over the first `dim` dims of a head (all of it but
    under partial rotary); applied in the rotate-half layout of HF weights."""

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        angles, attn = rope_angles(dim, max_positions, theta, scaling)
        self.dim = dim
        self.register_buffer("cos", (angles.cos() * attn).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * attn).float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions as [T, 1, D/2], looked up once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated over its first 2 * cos.shape[-1] dims; the rest pass through (partial rotary)."""
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot // 2], x[..., rot // 2:rot]
    parts = (x1 * cos - x2 * sin, x2 * cos + x1 * sin) + ((x[..., rot:],) if rot < x.shape[-1] else ())
    return torch.cat(parts, dim=-1)
