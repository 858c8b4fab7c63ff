"""The decoder's shape, read from a Hugging Face config.json (Llama family)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..kv_dtype import KVDtype

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...] = field(default=())
    sliding_window: int | None = None  # attention window, where the model uses one

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        mt = cfg.get("model_type", "llama")
        if mt not in SUPPORTED:
            raise ValueError(f"model_type {mt!r} is not supported; supported: {SUPPORTED}")
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", mt == "mistral") else None
        return cls(
            model_type=mt, hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", mt == "qwen2"), eos_token_ids=eos,
            sliding_window=window)

    def kv_bytes_per_token(self, kv: KVDtype) -> int:
        """M_KV per token, stored as `kv`: 2 (K and V) * L * d_kv * bytes, scales included."""
        return kv.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim)

    def check_tensor_parallel(self, n: int) -> None:
        """Each rank takes whole heads, KV heads, MLP columns and vocab rows."""
        parts = {"attention heads": self.num_heads, "KV heads": self.num_kv_heads,
                 "intermediate size": self.intermediate_size, "vocab size": self.vocab_size}
        bad = [f"{name} ({count})" for name, count in parts.items() if count % n]
        if bad:
            ok = [d for d in range(1, self.num_heads + 1) if all(c % d == 0 for c in parts.values())]
            raise ValueError(f"tensor_parallel_size {n} does not divide the model's {', '.join(bad)}; "
                             f"this model allows {ok}")

    def shard(self, n: int) -> "ModelConfig":
        """One rank's slice of the model under tensor parallelism of n."""
        if n == 1:
            return self
        self.check_tensor_parallel(n)
        return replace(self, num_heads=self.num_heads // n, num_kv_heads=self.num_kv_heads // n,
                       intermediate_size=self.intermediate_size // n, vocab_size=self.vocab_size // n)
