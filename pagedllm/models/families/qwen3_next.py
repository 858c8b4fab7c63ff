"""Qwen3-Next (model_type qwen3_next): gated DeltaNet layers (gated_deltanet.py), whose recurrent
state lives in the KV pool's blocks (kv.groups' STATE), beside every fourth layer's attention, which
gates its output by a sigmoid of a second half of q_proj and turns a quarter of each head by RoPE;
zero-centred RMSNorms (x * (1 + w)) but for the DeltaNet's gated output norm; a mixture of experts
with a gated shared expert on every layer.

Its checkpoints hold each DeltaNet's in_proj_qkvz grouped by key head (q, k, v, z of one head's
group, then the next), in_proj_ba likewise: the loader regroups the rows once (q of all heads, k, v,
z; b, a), so a step splits them as they come. A multi-token-prediction head (mtp.*) is dropped."""
from __future__ import annotations

from typing import Any

from ..deltanet_config import DeltaNetConfig
from ..family import Family, WeightMapper

STATE_TYPES, ATTENTION_TYPES = ("linear_attention",), ("full_attention",)


def own_config(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % cfg.get("full_attention_interval", 4) else
                                       "full_attention" for i in range(n)]
    unknown = sorted(set(types) - set(STATE_TYPES + ATTENTION_TYPES))
    if len(types) != n or unknown:
        raise ValueError(f"qwen3_next: layer_types {unknown or types} must give each of {n} layers one of "
                         f"{STATE_TYPES + ATTENTION_TYPES}")
    d = DeltaNetConfig(cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32),
                       cfg.get("linear_key_head_dim", 128), cfg.get("linear_value_head_dim", 128))
    if d.num_v_heads % d.num_k_heads:
        raise ValueError(f"qwen3_next: linear_num_value_heads {d.num_v_heads} must be a multiple of "
                         f"linear_num_key_heads {d.num_k_heads}")
    return {"state_layers": tuple(i for i, t in enumerate(types) if t in STATE_TYPES),
            "state_mixer": "gated_deltanet", "deltanet": d, "conv_kernel": cfg.get("linear_conv_kernel_dim", 4),
            "conv_bias": False}


def reorder(loaded: dict, cfg) -> None:
    """A multi-token-prediction head dropped; each DeltaNet's in_proj rows regrouped from per key
    head to per part (q, k, v, z; b, a), by list indexing (exact in any dtype)."""
    for name in [n for n in loaded if n.startswith("mtp.")]:
        del loaded[name]
    d = cfg.deltanet
    per = d.num_v_heads // d.num_k_heads
    width = 2 * d.k_dim + 2 * per * d.v_dim
    parts = ((0, d.k_dim), (d.k_dim, d.k_dim), (2 * d.k_dim, per * d.v_dim), (2 * d.k_dim + per * d.v_dim, per * d.v_dim))
    qkvz = [h * width + start + i for start, size in parts for h in range(d.num_k_heads) for i in range(size)]
    ba = [h * 2 * per + start + i for start in (0, per) for h in range(d.num_k_heads) for i in range(per)]
    for name in list(loaded):
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            loaded[name] = loaded[name][qkvz]
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            loaded[name] = loaded[name][ba]


QWEN3_NEXT = Family(
    architecture="Qwen3NextForCausalLM", qk_norm=True, attn_output_gate=True, moe=True, moe_norm_topk=True,
    own_config=own_config,
    weights=WeightMapper(norm_offset=1.0, plain_norms=("linear_attn.norm.weight",), reorder=reorder),
    no_tensor_parallel="its gated DeltaNet layers are not sharded over ranks yet",
    stop_tokens=("<|im_end|>",))
