"""PEFT adapters made on the default SmolLM2 base for the LoRA tests: random in both A and B
(PEFT's init_lora_weights=False), so that each moves greedy tokens."""
from __future__ import annotations

import torch


def make_adapter(model_dir, out, seed: int, rank: int, alpha: int, targets: list[str], rslora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # PEFT's random init, scaled so the adapter moves greedy tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5 if "lora_B" in name else 1.0)
    model.save_pretrained(out)
    return out
