"""The model registry: an HF config's model_type -> its family (family.Family: the decoder that runs
it, that decoder's options, its weight mapper), one line a family. A new architecture is a file of
its own (its decoder, or its rows in families/ where the shared decoder runs it) and a line here.

Torch-free, as the rows are: config.py reads a family before any model is built, and the loader
its GGUF rows. The decoder class is imported when a model is built (decoder_for)."""
from __future__ import annotations

import importlib

from .families import (deepseek, gemma3, gpt_oss, granite_hybrid, lfm2, llama, mixtral, nemotron_h, olmoe, phi3,
                       qwen, qwen3_next)
from .family import Family

FAMILIES: dict[str, Family] = {
    "llama": llama.LLAMA,
    "mistral": llama.MISTRAL,
    "qwen2": qwen.QWEN2,
    "qwen3": qwen.QWEN3,
    "smollm3": llama.SMOLLM3,
    "phi3": phi3.PHI3,
    "gemma3_text": gemma3.GEMMA3,
    "qwen3_moe": qwen.QWEN3_MOE,
    "qwen2_moe": qwen.QWEN2_MOE,
    "olmoe": olmoe.OLMOE,
    "mixtral": mixtral.MIXTRAL,
    "lfm2": lfm2.LFM2,
    "granitemoehybrid": granite_hybrid.GRANITE_HYBRID,
    "deepseek_v2": deepseek.DEEPSEEK_V2,
    "deepseek_v3": deepseek.DEEPSEEK_V3,
    "gpt_oss": gpt_oss.GPT_OSS,
    "qwen3_next": qwen3_next.QWEN3_NEXT,
    "nemotron_h": nemotron_h.NEMOTRON_H,
}
SUPPORTED = tuple(FAMILIES)
# model_types a family's checkpoints use that we do not run, and why (the error says what runs instead)
NOT_RUN: dict[str, str] = {**gemma3.NOT_RUN}

# general.architecture of the GGUF files we read (several families may share one: see gguf_model_type)
GGUF_ARCHITECTURES = tuple(dict.fromkeys(f.gguf.arch for f in FAMILIES.values() if f.gguf is not None))


def family(model_type: str) -> Family:
    """The family of `model_type`; ValueError naming it and what is supported."""
    if model_type in NOT_RUN:
        raise ValueError(f"model_type {model_type!r} is {NOT_RUN[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return FAMILIES[model_type]


def decoder_for(model_type: str) -> type:
    """The class that runs `model_type`: built as cls(cfg, backend, kernels, tp) (ValueError as family())."""
    module, _, name = family(model_type).decoder.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def gguf_model_type(arch: str, expert_count: int | None = None) -> str | None:
    """The model_type of a GGUF file of architecture `arch` (None: not one we read). Where families
    share an architecture, the file's experts (its {arch}.expert_count) tell them apart."""
    found = [mt for mt, f in FAMILIES.items() if f.gguf is not None and f.gguf.arch == arch]
    if len(found) > 1:
        found = [mt for mt in found if FAMILIES[mt].gguf.experts == bool(expert_count)]
    return found[0] if found else None
