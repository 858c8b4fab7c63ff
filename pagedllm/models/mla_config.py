"""Multi-head latent attention's shape (DeepSeek-V2/V3), as a family reads it from its config
(families/deepseek.py) and the decoder builds it (mla.py). Plain data: config.py imports it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    """Each token's keys and values are kept as one compressed latent of kv_lora_rank values plus
    a rotary key of rope_dim shared by every head: the pool's K rows hold the two side by side
    (one KV head of kv_lora_rank + rope_dim) and its V rows nothing, since a head's value is read
    from the latent too (mla.py absorbs the up-projections into the query and the output).
    q_lora_rank: the query's own compression (0: one q_proj matmul)."""
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int        # each head's key dims without RoPE (qk_nope_head_dim)
    rope_dim: int        # each head's rotary key dims (qk_rope_head_dim)
    v_dim: int           # each head's value dims (v_head_dim)
    rope_interleaved: bool = True   # the checkpoint's rotary dims in pairs (x0, x1), (x2, x3)...

    @property
    def latent(self) -> int:
        """One token's cached values a layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.rope_dim

    def expanded(self, num_heads: int) -> int:
        """One token's K and V values a layer with the latent expanded to full heads (as
        transformers caches them), for comparison: heads x (nope + rope + v)."""
        return num_heads * (self.nope_dim + self.rope_dim + self.v_dim)
