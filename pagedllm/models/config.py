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
    sliding_window: int | None = None  # the widest layer's attention window, where the model uses one
    # Each layer's window W (a query at p sees keys p - W < j <= p), 0 for full attention;
    # empty: every layer full.
    layer_windows: tuple[int, ...] = field(default=())

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
        windows = layer_windows(cfg, mt)
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
            sliding_window=max(windows, default=0) or None, layer_windows=windows if any(windows) else ())

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def kv_window(self) -> int:
        """The window by which a sequence's old blocks can be released: the widest one when
        every layer is windowed, 0 when any layer attends to every key (it needs them all)."""
        if not self.layer_windows or 0 in self.layer_windows:
            return 0
        return max(self.layer_windows)

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


LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def layer_windows(cfg: dict[str, Any], model_type: str) -> tuple[int, ...]:
    """Each layer's window from an HF config, as transformers reads it: Mistral windows
    every layer by `sliding_window` (its config has no per-layer pattern); Qwen2 windows the
    layers `layer_types` marks "sliding_attention" (transformers 5), or else those from
    `max_window_layers` on, and only when `use_sliding_window` is set. 0: full attention."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or 0
    if not cfg.get("use_sliding_window", model_type == "mistral") or not window:
        return (0,) * n
    if window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
    if model_type == "mistral":
        return (window,) * n
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", n)
        return tuple(window if i >= first else 0 for i in range(n))
    unknown = sorted(set(types) - LAYER_TYPES.keys())
    if unknown:
        raise ValueError(f"layer_types: {unknown} not supported; each layer must be one of {sorted(LAYER_TYPES)}")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers (num_hidden_layers)")
    return tuple(window if LAYER_TYPES[t] else 0 for t in types)
