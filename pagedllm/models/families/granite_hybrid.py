"""Granite 4.0-H (model_type granitemoehybrid): Mamba-2 layers (mamba2.py), whose state lives in
the KV pool's blocks (kv.groups' STATE), beside a few attention layers without RoPE (unless
position_embedding_type is "rope"); a gated MLP its checkpoints call shared_mlp, with gate and
up in one input_linear; and Granite's scalars: embeddings, each sublayer's output and the
logits scaled, the attention's softmax by attention_multiplier.

Its variants with experts (Granite 4.0-H-Tiny and -Small: num_local_experts > 0) run a mixture
(moe.py) in every layer, its router a softmax over the top k's logits (the top k of a softmax,
renormalized), with shared_mlp beside it as an ungated shared expert. Their checkpoints hold the
experts stacked: block_sparse_moe.input_linear [E, 2I, H] (gate over up, our w13),
output_linear [E, H, I] (our w2), router.layer [E, H]."""
from __future__ import annotations

from typing import Any

from ..family import Family, WeightMapper, config_number
from ..mamba_config import MambaConfig
from ..moe_config import MoEConfig

# Theirs -> ours, part by part (the fused gate/up is already ours: input_linear is gate then up);
# a mixture's tensors are placed by reorder below.
_NAMES = (("shared_mlp", "mlp"), ("input_linear", "gate_up_proj"), ("output_linear", "down_proj"),
          ("block_sparse_moe", "experts_block"))
_STACKED = {"experts_block.gate_up_proj.weight": "mlp.w13", "experts_block.down_proj.weight": "mlp.w2",
            "experts_block.router.layer.weight": "mlp.gate.weight"}
STATE_TYPES, ATTENTION_TYPES = ("mamba", "linear_attention"), ("attention", "full_attention")


def own_config(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    unknown = sorted(set(types) - set(STATE_TYPES + ATTENTION_TYPES))
    if len(types) != n or unknown:
        raise ValueError(f"granitemoehybrid: layer_types {unknown or types} must give each of {n} layers one of "
                         f"{STATE_TYPES + ATTENTION_TYPES}")
    if cfg.get("position_embedding_type") not in (None, "nope", "rope"):
        raise ValueError(f"granitemoehybrid: position_embedding_type {cfg['position_embedding_type']!r} is not "
                         "supported (None or 'rope' are)")
    inner = cfg.get("mamba_expand", 2) * cfg["hidden_size"]
    heads = cfg.get("mamba_n_heads", 128)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else head_dim
    if heads * head_dim != inner or heads % cfg.get("mamba_n_groups", 1):
        raise ValueError(f"granitemoehybrid: mamba_n_heads {heads} x mamba_d_head {head_dim} must be "
                         f"mamba_expand x hidden_size ({inner}), in whole groups of heads")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    nope = cfg.get("position_embedding_type") != "rope"
    shared = cfg.get("shared_intermediate_size", 1024)
    return {"intermediate_size": shared, "moe": _experts(cfg, shared),
            "state_layers": tuple(i for i, t in enumerate(types) if t in STATE_TYPES), "state_mixer": "mamba2",
            "mamba": MambaConfig(heads, head_dim, cfg.get("mamba_n_groups", 1), cfg.get("mamba_d_state", 256),
                                 bool(cfg.get("mamba_proj_bias", False)),
                                 (config_number(limit[0]), config_number(limit[1]))),
            "conv_kernel": cfg.get("mamba_d_conv", 4), "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
            "attn_scale": float(cfg.get("attention_multiplier", 1.0)),
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "logit_scale": 1.0 / float(cfg.get("logits_scaling", 1.0)),
            "layer_ropes": (-1,) * n if nope else ()}


def _experts(cfg: dict[str, Any], shared: int) -> MoEConfig | None:
    """The mixture of a variant with experts (None: the dense one, shared_mlp alone)."""
    e, k, width = cfg.get("num_local_experts") or 0, cfg.get("num_experts_per_tok"), cfg.get("intermediate_size")
    if not e:
        return None
    if not all(isinstance(v, int) and v > 0 for v in (e, k, width)) or k > e:
        raise ValueError(f"granitemoehybrid: num_local_experts ({e}), num_experts_per_tok ({k}) and intermediate_size "
                         f"({width}) must be positive ints, top k at most the experts")
    return MoEConfig(e, k, width, norm_topk=True, shared_width=shared, shared_gated=False)


def reorder(loaded: dict[str, Any], cfg) -> None:
    """A variant with experts: its stacked experts and router into the mixture's w13, w2 and gate,
    shared_mlp (renamed mlp) into the mixture's shared expert."""
    if cfg.moe is None:
        return
    for name in [n for n in loaded if ".mlp." in n or ".experts_block." in n]:
        layer, _, rest = name.partition(".experts_block.")
        if rest:
            key = "experts_block." + rest
            if key not in _STACKED:
                raise ValueError(f"granitemoehybrid: unexpected tensor {name}")
            loaded[f"{layer}.{_STACKED[key]}"] = loaded.pop(name)
        else:
            loaded[name.replace(".mlp.", ".mlp.shared_expert.")] = loaded.pop(name)



GRANITE_HYBRID = Family(
    architecture="GraniteMoeHybridForCausalLM", own_config=own_config,
    weights=WeightMapper(renames=_NAMES, reorder=reorder),
    no_tensor_parallel="its Mamba layers are not sharded over ranks yet")
