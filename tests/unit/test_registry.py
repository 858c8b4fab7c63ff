"""The model registry (models/registry.py): every model_type it lists resolves to a family and a
decoder that builds from a config of that type; an unknown one fails naming itself and what is
supported; the GGUF rows and the weight mappers say what they did before they were data. And the
issue's rule, read from the code: no branch on a family's name outside its file and the registry."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from pagedllm.models import ModelConfig
from pagedllm.models.registry import (FAMILIES, GGUF_ARCHITECTURES, NOT_RUN, SUPPORTED, decoder_for, family,
                                      gguf_model_type)

from .test_layering import PACKAGE, modules, unit

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 128,
        # read by the mixtures only (each names its experts' width under one of the two keys)
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# what a family needs named beside TINY: Nemotron-H's blocks (a Mamba-2 and an MLP block, an attention block: two layers)
OWN = {"nemotron_h": {"layers_block_type": ["linear_attention", "mlp", "full_attention"]}}


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_every_registered_model_type_builds(model_type):
    cfg = ModelConfig.from_hf({**TINY, **OWN.get(model_type, {}), "model_type": model_type})
    assert cfg.family is family(model_type) is FAMILIES[model_type]
    cls = decoder_for(model_type)
    assert issubclass(cls, nn.Module)
    with torch.device("meta"):
        model = cls(cfg, backend=None)
    assert len(model.layers) == 2 and (cfg.moe is not None) == bool(model.mixtures())
    assert "Llama" not in cls.__name__ or model_type == "llama"   # a class says what it runs


def test_an_unknown_model_type_names_itself_and_what_is_supported():
    with pytest.raises(ValueError) as err:
        family("falcon_h1")
    assert str(err.value) == f"model_type 'falcon_h1' is not supported; supported: {', '.join(SUPPORTED)}"
    with pytest.raises(ValueError, match="model_type 'falcon_h1' is not supported"):
        decoder_for("falcon_h1")


def test_a_checkpoint_kind_a_family_does_not_run_says_what_does():
    for model_type in NOT_RUN:
        assert model_type not in FAMILIES
        with pytest.raises(ValueError, match=f"model_type '{model_type}' is "):
            family(model_type)
    with pytest.raises(ValueError, match="gemma3_text"):
        family("gemma3")


def test_gguf_architectures_resolve_to_their_families():
    assert len(set(GGUF_ARCHITECTURES)) == len(GGUF_ARCHITECTURES)
    assert {a: gguf_model_type(a) for a in ("llama", "gemma3", "qwen3moe", "olmoe", "gpt2")} == \
        {"llama": "llama", "gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "gpt2": None}
    assert gguf_model_type("llama", 8) == "mixtral"   # llama.cpp writes Mixtral as "llama" with experts
    for arch in GGUF_ARCHITECTURES:
        assert FAMILIES[gguf_model_type(arch)].gguf.arch == arch


def test_weight_mappers_rename_each_name_once():
    gemma, mixtral = FAMILIES["gemma3_text"].weights, FAMILIES["mixtral"].weights
    assert gemma.name("layers.0.post_attention_layernorm.weight") == "layers.0.attn_output_norm.weight"
    assert gemma.name("layers.0.pre_feedforward_layernorm.weight") == "layers.0.post_attention_layernorm.weight"
    assert mixtral.name("layers.1.block_sparse_moe.experts.3.w1.weight") == "layers.1.mlp.experts.3.gate_proj.weight"
    assert FAMILIES["llama"].weights.name("layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"


def test_the_chat_templates_families_name_are_shipped():
    shipped = PACKAGE / "loader" / "chat_templates"
    for f in FAMILIES.values():
        assert not f.chat_template or (shipped / f.chat_template).is_file(), f.chat_template


GENERIC = ("runtime", "engine", "kv", "loader", "models")   # the code that must not know families by name
FAMILY_HOMES = ("pagedllm.models.families", "pagedllm.models.registry")


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def test_no_branch_on_a_family_name_outside_its_file_and_the_registry():
    """A comparison with a family's model_type or GGUF architecture as a literal is a branch on
    that family: it belongs in the family's row. Tables of names (data) are not comparisons."""
    names = set(FAMILIES) | set(NOT_RUN) | set(GGUF_ARCHITECTURES)
    found = []
    for module, path in modules().items():
        if unit(module) not in GENERIC or module.startswith(FAMILY_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                hit = names.intersection(s for side in (node.left, *node.comparators) for s in _strings(side))
                if hit:
                    found.append(f"{Path(path).relative_to(PACKAGE.parent)}:{node.lineno}: {sorted(hit)}")
    assert not found, "branches on a family name:\n" + "\n".join(found)
