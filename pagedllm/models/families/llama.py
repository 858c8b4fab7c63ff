"""Llama 2/3 (and SmolLM2, which is one), Mistral and SmolLM3: the shared decoder as it is."""
from __future__ import annotations

from ..family import EVERY_LAYER, QWEN_LAYERS, Family, GGUFArch

# llama.cpp writes Mixtral as "llama" too, with experts (families/mixtral.py)
LLAMA = Family(architecture="LlamaForCausalLM", gguf=GGUFArch("llama"))
MISTRAL = Family(windows=EVERY_LAYER, architecture="MistralForCausalLM", gguf=GGUFArch("mistral"))
# NoPE layers: config.from_hf reads no_rope_layers
SMOLLM3 = Family(windows=QWEN_LAYERS, architecture="SmolLM3ForCausalLM")
