"""LFM2 (Liquid AI): a hybrid of gated short convolutions (short_conv.py), whose state is the last
K - 1 inputs of each sequence (kv.groups' STATE blocks), and a few attention layers with a
per-head QK-norm; SwiGLU MLPs whose width the config derives, and a norm after the embeddings'
last layer that transformers calls embedding_norm. Its GGUF files (Liquid AI's, llama.cpp's "lfm2")
are converted by transformers' reader (the KV heads a list per layer, 0 on a convolution layer; the
MLP width as built), their matmuls run as the file's blocks."""
from __future__ import annotations

from typing import Any

from ..family import Family, GGUFArch, WeightMapper

# Theirs -> ours, part by part: out_proj is the attention's o_proj and the convolution's alike.
_NAMES = (("operator_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
          ("feed_forward", "mlp"), ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"),
          ("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"), ("out_proj", "o_proj"),
          ("embedding_norm", "norm"))
LAYER_TYPES = ("full_attention", "conv")


def mlp_width(cfg: dict[str, Any]) -> int:
    """The MLP's width from block_ff_dim (intermediate_size): 2/3 of it, times the multiplier,
    rounded up to block_multiple_of, when block_auto_adjust_ff_dim (as transformers' Lfm2MLP)."""
    width = cfg.get("block_ff_dim", cfg["intermediate_size"])
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier, multiple = cfg.get("block_ffn_dim_multiplier", 1.0), cfg.get("block_multiple_of", 256)
    if multiplier is not None:
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def own_config(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        attn = cfg.get("full_attn_idxs")
        types = ["full_attention" if attn is None or i in attn else "conv" for i in range(n)]
    if len(types) != n or set(types) - set(LAYER_TYPES):
        raise ValueError(f"lfm2: layer_types {types} must give each of {n} layers one of {LAYER_TYPES}")
    kernel = cfg.get("conv_L_cache", 3)
    if not isinstance(kernel, int) or kernel < 2:
        raise ValueError(f"lfm2: conv_L_cache {kernel} must be an int >= 2")
    return {"intermediate_size": mlp_width(cfg), "rms_norm_eps": cfg.get("norm_eps", 1e-5),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True)),
            "state_layers": tuple(i for i, t in enumerate(types) if t == "conv"), "state_mixer": "short_conv",
            "conv_kernel": kernel, "conv_bias": bool(cfg.get("conv_bias", False))}


LFM2 = Family(
    architecture="Lfm2ForCausalLM", qk_norm=True, rope_theta=1_000_000.0, own_config=own_config,
    weights=WeightMapper(renames=_NAMES),
    no_tensor_parallel="its convolution layers are not sharded over ranks yet",
    stop_tokens=("<|im_end|>",), gguf=GGUFArch("lfm2"))
