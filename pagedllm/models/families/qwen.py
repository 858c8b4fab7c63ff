"""Qwen2 and Qwen3, dense and mixtures of experts (models/moe.py)."""
from __future__ import annotations

from ..family import QWEN_LAYERS, Family, GGUFArch

QWEN2 = Family(qkv_bias=True, windows=QWEN_LAYERS, architecture="Qwen2ForCausalLM", gguf=GGUFArch("qwen2"))
QWEN3 = Family(qk_norm=True, windows=QWEN_LAYERS, architecture="Qwen3ForCausalLM", gguf=GGUFArch("qwen3"))
# Their GGUF files' routing, as llama.cpp's graphs run it: qwen3moe renormalizes the top k, qwen2moe does not.
QWEN3_MOE = Family(qk_norm=True, windows=QWEN_LAYERS, moe=True, architecture="Qwen3MoeForCausalLM",
                   gguf=GGUFArch("qwen3moe", experts=True, expert_keys=True, config=(("norm_topk_prob", True),)))
# a shared expert beside the routed ones, gated by a sigmoid
QWEN2_MOE = Family(qkv_bias=True, windows=QWEN_LAYERS, moe=True, architecture="Qwen2MoeForCausalLM",
                   gguf=GGUFArch("qwen2moe", experts=True, expert_keys=True, config=(("norm_topk_prob", False),)))
