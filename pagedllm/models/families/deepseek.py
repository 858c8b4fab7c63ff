"""DeepSeek-V2 and -V3 (model_types deepseek_v2, deepseek_v3): multi-head latent attention (mla.py,
its latent paged as one K head a layer) and a mixture of experts with shared experts always added,
routed by DeepSeek's own routers (softmax, or sigmoid with a bias that only picks; greedy, or top k
within the best groups; weights scaled), dense MLPs in the first first_k_dense_replace layers.
YaRN's attention factor scales the softmax by mscale(mscale_all_dim)^2, as DeepSeek's reference does.

The checkpoints lay each head's rotary dims out in pairs (x0, x1), (x2, x3)...; our RoPE turns
dim i with dim i + d/2. Only dot products of rotated q and k are ever taken, so the loader reorders
those rows once (evens, then odds) in both q's and the latent's weights, and the one RoPE serves."""
from __future__ import annotations

import re
from typing import Any

from ..family import Family, WeightMapper
from ..mla_config import MLAConfig
from ..moe_config import MoEConfig
from ..rope_scaling import yarn_mscale

_LAYER = re.compile(r"layers\.(\d+)\.")
# transformers' defaults of the keys read here (DeepseekV2Config's and DeepseekV3Config's)
_SHARED = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128}
_V2 = {**_SHARED, "n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1407,
       "first_k_dense_replace": 0, "topk_method": "greedy"}
_V3 = {**_SHARED, "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048,
       "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "norm_topk_prob": True,
       "routed_scaling_factor": 2.5}


def own_config(cfg: dict[str, Any]) -> dict[str, Any]:
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    v3 = mt == "deepseek_v3"
    cfg = {**(_V3 if v3 else _V2), **cfg}   # transformers' defaults, for a config that leaves a key out
    rank, rope, nope, v = (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"])
    mla = MLAConfig(cfg.get("q_lora_rank") or 0, rank, nope, rope, v,
                    rope_interleaved=not v3 or cfg.get("rope_interleave", True))
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    methods = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}[mt]
    if method not in methods:
        raise ValueError(f"{mt}: topk_method {method!r} is not supported ({', '.join(methods)} are)")
    experts, k = cfg.get("n_routed_experts"), cfg.get("num_experts_per_tok")
    if not experts or not k:
        raise ValueError(f"{mt}: n_routed_experts ({experts}) and num_experts_per_tok ({k}) must be set")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{mt}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (1 is)")
    grouped = method != "greedy"
    groups, topk_group = (cfg.get("n_group") or 1, cfg.get("topk_group") or 1) if grouped else (1, 1)
    if experts % groups or topk_group > groups:
        raise ValueError(f"{mt}: n_routed_experts {experts} in n_group {groups} groups, topk_group {topk_group}")
    dense = cfg.get("first_k_dense_replace", 0)
    moe = None if dense >= n else MoEConfig(
                    experts, k, cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False)),
                    cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                    tuple(i >= dense for i in range(n)) if dense else (), shared_gated=False,
                    scoring="sigmoid" if v3 else "softmax", choice_bias=v3,
                    groups=groups, topk_group=topk_group, routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)))
    return {"num_kv_heads": 1, "head_dim": mla.latent, "rotary_dim": rope, "mla": mla, "moe": moe,
            "attn_scale": _scale(cfg, nope + rope)}


def _scale(cfg: dict[str, Any], qk_dim: int) -> float:
    """The softmax scale of the full heads' q.k: qk_dim^-0.5, times YaRN's mscale(mscale_all_dim)^2."""
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    scale = qk_dim ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def reorder(loaded: dict, cfg) -> None:
    """The checkpoint's tensors (our names) before they load: a multi-token-prediction layer past
    num_hidden_layers dropped (DeepSeek-V3's, which decoding does not run), and the rotary rows of
    q and of the latent's projection reordered from interleaved pairs to halves (module doc)."""
    for name in [n for n in loaded if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_layers]:
        del loaded[name]
    m = cfg.mla
    if not m.rope_interleaved:
        return
    halves = list(range(0, m.rope_dim, 2)) + list(range(1, m.rope_dim, 2))
    qk = m.nope_dim + m.rope_dim
    q_rows = [h * qk + (i if i < m.nope_dim else m.nope_dim + halves[i - m.nope_dim])
              for h in range(cfg.num_heads) for i in range(qk)]
    kv_rows = list(range(m.kv_lora_rank)) + [m.kv_lora_rank + i for i in halves]
    for name in list(loaded):
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            rows = q_rows
        elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
            rows = kv_rows
        else:
            continue
        loaded[name] = loaded[name][rows]   # a list of ints: exact indices whatever the weights' dtype


_WEIGHTS = WeightMapper(renames=(("shared_experts", "shared_expert"),), reorder=reorder)
_NO_TP = "its latent attention is not sharded over ranks yet"
DEEPSEEK_V2 = Family(architecture="DeepseekV2ForCausalLM", own_config=own_config, weights=_WEIGHTS,
                     no_tensor_parallel=_NO_TP)
DEEPSEEK_V3 = Family(architecture="DeepseekV3ForCausalLM", own_config=own_config, weights=_WEIGHTS,
                     no_tensor_parallel=_NO_TP)
