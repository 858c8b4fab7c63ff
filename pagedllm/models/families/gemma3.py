"""Gemma 3 (text): QK-norm, sandwich norms, scaled embeddings, a GELU gate, and windowed layers
with a RoPE base of their own."""
from __future__ import annotations

from ..family import LAYER_TYPES_ONLY, Family, GGUFArch, WeightMapper

# Gemma 3 calls its pre-MLP norm pre_feedforward_layernorm, and its post_attention_layernorm
# normalises the attention's output; ours keep Llama's meaning of post_attention_layernorm.
_NORMS = (("post_attention_layernorm", "attn_output_norm"),
          ("pre_feedforward_layernorm", "post_attention_layernorm"),
          ("post_feedforward_layernorm", "mlp_output_norm"))

GEMMA3 = Family(
    qk_norm=True, sandwich_norms=True, embed_scale=True, windows=LAYER_TYPES_ONLY, architecture="Gemma3ForCausalLM",
    rope_theta=1_000_000.0, local_rope_theta=10_000.0,
    weights=WeightMapper(renames=_NORMS, norm_offset=1.0),   # its norms are x * (1 + w)
    stop_tokens=("<end_of_turn>",), chat_template="gemma.jinja",   # base models' files carry no template
    gguf=GGUFArch("gemma3"))

# model_types of its checkpoints that it does not run, and what runs instead
NOT_RUN = {"gemma3": "Gemma 3's image-text checkpoint; its language model alone (model_type 'gemma3_text', "
                     "Gemma3ForCausalLM) is supported"}
