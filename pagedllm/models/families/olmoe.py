"""OLMoE: a mixture of experts (models/moe.py) with QK-norm over all heads at once."""
from __future__ import annotations

from ..family import Family, GGUFArch

OLMOE = Family(
    qk_norm_whole=True, moe=True, expert_width_key="intermediate_size", architecture="OlmoeForCausalLM",
    # transformers' GGUF reader has no OLMoE: gguf_moe.py converts its files
    gguf=GGUFArch("olmoe", experts=True, convert=True, config=(("norm_topk_prob", False), ("clip_qkv", None))))
