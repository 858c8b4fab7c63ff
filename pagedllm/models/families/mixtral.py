"""Mixtral: a mixture of experts (models/moe.py) on Mistral's layers, under checkpoint names of its own."""
from __future__ import annotations

from ..family import EVERY_LAYER, Family, GGUFArch, WeightMapper

MIXTRAL = Family(
    windows=EVERY_LAYER, moe=True, expert_width_key="intermediate_size", moe_norm_topk=True,
    architecture="MixtralForCausalLM",
    weights=WeightMapper(renames=(("block_sparse_moe", "mlp"), ("w1", "gate_proj"), ("w3", "up_proj"),
                                  ("w2", "down_proj"))),
    # llama.cpp writes it as "llama" with expert tensors, which transformers' reader reads as a dense Llama
    gguf=GGUFArch("llama", experts=True, convert=True, expert_count_key="num_local_experts",
                  config=(("sliding_window", None),)))
