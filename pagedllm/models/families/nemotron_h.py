"""Nemotron-H (NVIDIA; model_type nemotron_h: Nemotron-H 4B-56B, Nemotron Nano 2): a stack of blocks
of one mixer each, behind a pre-norm and a residual add: Mamba-2 (mamba2.py, its state in the pool's
STATE blocks), attention without RoPE (grouped KV heads, no biases), or an MLP of up, ReLU squared
and down (no gate). The config names the blocks in layers_block_type (linear_attention,
full_attention, mlp, moe), or, in the checkpoints NVIDIA published, in hybrid_override_pattern ("M"
Mamba-2, "*" attention, "-" MLP, "E" experts), their tensors under backbone. rather than model.

We run each Mamba-2 or attention block with the MLP blocks that follow it as one of our layers
(nemotron_h.py), so that a layer keeps one kind of cache and an MLP block none: ModelConfig.num_layers
counts these, trailing_mlps gives each its MLP blocks. The Mamba-2 gated norm is taken over n_groups
groups of channels. The variants with experts (moe blocks: Nemotron 3 Nano's ungated ReLU-squared
experts and their router) and a pattern that starts with an MLP block are refused by name.

dt runs unclamped (time_step_limit, (0, inf) in every published config), as NVIDIA's and vLLM's
Mamba-2 run it; transformers' own prefill clamps it below at time_step_min (its decode does not)."""
from __future__ import annotations

from typing import Any

from ..family import Family, WeightMapper, config_number
from ..mamba_config import MambaConfig

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MIXERS = ("linear_attention", "full_attention")   # the blocks that start one of our layers


def block_types(cfg: dict[str, Any]) -> list[str]:
    """Each block's type, from layers_block_type or hybrid_override_pattern; ValueError naming a
    block we do not run."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    pattern = cfg.get("hybrid_override_pattern")
    if not types and pattern:
        unknown = sorted(set(pattern) - PATTERN.keys())
        if unknown:
            raise ValueError(f"nemotron_h: hybrid_override_pattern has {unknown}; each block is one of "
                             f"{sorted(PATTERN)} ({', '.join(f'{k} {v}' for k, v in PATTERN.items())})")
        types = [PATTERN[ch] for ch in pattern]
    if not types:
        raise ValueError("nemotron_h: the config names no blocks (layers_block_type or hybrid_override_pattern)")
    unknown = sorted(set(types) - set(PATTERN.values()))
    if unknown:
        raise ValueError(f"nemotron_h: layers_block_type has {unknown}; each block is one of "
                         f"{sorted(PATTERN.values())}")
    if "moe" in types:
        raise ValueError("nemotron_h: blocks of experts (moe: Nemotron 3 Nano's ungated ReLU-squared experts and "
                         "their router) are not run yet; the dense Nemotron-H (Mamba-2, attention and MLP blocks) is")
    if types[0] == "mlp":
        raise ValueError("nemotron_h: a stack that starts with an MLP block is not run: each of our layers starts "
                         "with a Mamba-2 or attention block")
    return list(types)


def layers_of(types: list[str]) -> tuple[list[str], tuple[int, ...]]:
    """(each of our layers' mixer block type, how many MLP blocks follow it)."""
    mixers: list[str] = []
    trailing: list[int] = []
    for t in types:
        if t in MIXERS:
            mixers.append(t)
            trailing.append(0)
        else:
            trailing[-1] += 1
    return mixers, tuple(trailing)


def hf_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """The keys the shared reader takes under Nemotron-H's names: our layers' count (its blocks
    regrouped), the norms' epsilon; its MLP's activation is read by own_config."""
    mixers, _ = layers_of(block_types(cfg))
    out = {k: v for k, v in cfg.items() if k not in ("hidden_act", "hidden_activation")}
    return {**out, "num_hidden_layers": len(mixers), "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5)}


def own_config(cfg: dict[str, Any]) -> dict[str, Any]:
    mixers, trailing = layers_of(block_types(cfg))
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise ValueError(f"nemotron_h: {key} {cfg[key]!r} is not supported ({want!r} is)")
    heads, head_dim = cfg.get("mamba_num_heads", 128), cfg.get("mamba_head_dim", 64)
    groups = cfg.get("n_groups", cfg.get("mamba_n_groups", 8))
    if not all(isinstance(v, int) and v > 0 for v in (heads, head_dim, groups)) or heads % groups:
        raise ValueError(f"nemotron_h: mamba_num_heads {heads} must be a positive multiple of n_groups {groups}, "
                         f"mamba_head_dim {head_dim} positive")
    limit = cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0.0, float("inf"))
    mamba = MambaConfig(heads, head_dim, groups, cfg.get("ssm_state_size", 128), bool(cfg.get("use_bias", False)),
                        (config_number(limit[0]), config_number(limit[1])), norm_groups=groups)
    return {"state_layers": tuple(i for i, t in enumerate(mixers) if t == "linear_attention"),
            "state_mixer": "mamba2", "mamba": mamba, "conv_kernel": cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
            "conv_bias": bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
            "layer_ropes": (-1,) * len(mixers), "trailing_mlps": trailing,
            "qkv_bias": False}   # its attention has no biases whatever attention_bias says (as transformers')


def reorder(loaded: dict[str, Any], cfg) -> None:
    """Its blocks' tensors under our layers: block j's norm and mixer into the layer it starts
    (input_layernorm, mamba.* or self_attn.*) or into that layer's mlps.s (norm, up_proj, down_proj);
    NVIDIA's backbone. prefix dropped (transformers' model. is dropped before)."""
    where: list[tuple[int, int]] = []   # block j -> (our layer, -1 for its mixer or s for its s-th MLP block)
    for layer, n in enumerate(cfg.trailing_mlps):
        where += [(layer, -1)] + [(layer, s) for s in range(n)]
    for name in list(loaded):
        ours = name.removeprefix("backbone.")
        parts = ours.split(".")
        if parts[0] == "layers" and len(parts) > 2:
            j = int(parts[1])
            if j >= len(where):
                raise ValueError(f"nemotron_h: checkpoint tensor {name} of block {j}, the config names {len(where)}")
            layer, s = where[j]
            kind, rest = parts[2], ".".join(parts[3:])   # "norm", or "mixer" and the mixer's own name
            if kind == "norm":
                ours = f"layers.{layer}.{'input_layernorm' if s < 0 else f'mlps.{s}.norm'}.{rest}"
            elif s >= 0:
                ours = f"layers.{layer}.mlps.{s}.{rest}"
            else:
                ours = f"layers.{layer}.{'mamba' if layer in cfg.state_layers else 'self_attn'}.{rest}"
        if ours != name:
            loaded[ours] = loaded.pop(name)



NEMOTRON_H = Family(
    architecture="NemotronHForCausalLM", decoder="nemotron_h:NemotronHForCausalLM", own_config=own_config,
    hf_keys=hf_keys, weights=WeightMapper(renames=(("embeddings", "embed_tokens"), ("norm_f", "norm")),
                                          reorder=reorder),
    no_tensor_parallel="its Mamba layers are not sharded over ranks yet")
