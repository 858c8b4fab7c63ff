"""gpt-oss (model_type gpt_oss): attention with a learned sink logit per head, windowed and full
layers alternating (layer_types), biases on q/k/v and o, YaRN; every layer a mixture of experts
whose router has a bias, whose experts have biases and a clamped SwiGLU ((up + 1) * g * sigmoid(1.702 g),
gate clamped above and up both sides at swiglu_limit), and whose top k's weights are the softmax of
their logits.

Its checkpoints hold each layer's experts stacked and transposed (gate_up_proj [E, H, 2I], down_proj
[E, I, H]), gate and up columns interleaved: the loader turns them into our [E, 2I, H] gate over up
and [E, H, I] once. MXFP4 checkpoints hold them as blocks (gate_up_proj_blocks / _scales) in the
output-major layout we compute them in (quantization.py's mxfp4)."""
from __future__ import annotations

import re
from typing import Any

from ..family import LAYER_TYPES_ONLY, Family, GGUFArch, WeightMapper
from ..moe_config import MoEConfig

_EXPERTS = re.compile(r"(layers\.\d+\.mlp\.)experts\.(gate_up_proj|down_proj)(_bias|_blocks)?")


def own_config(cfg: dict[str, Any]) -> dict[str, Any]:
    mt = cfg["model_type"]
    experts, k = cfg.get("num_local_experts") or cfg.get("num_experts"), cfg.get("num_experts_per_tok")
    width = cfg.get("intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (experts, k, width)) or k > experts:
        raise ValueError(f"{mt}: num_local_experts ({experts}), num_experts_per_tok ({k}) and intermediate_size "
                         f"({width}) must be positive ints, top k at most the experts")
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ValueError(f"{mt}: quantization_config.quant_method {quant!r} is not supported (mxfp4 experts, or none, are)")
    bias = bool(cfg.get("attention_bias", True))
    moe = MoEConfig(experts, k, width, norm_topk=True, router_bias=True, expert_bias=True,
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                    blocks="MXFP4" if quant == "mxfp4" else "")
    return {"moe": moe, "activation": "swiglu_oai", "qkv_bias": bias, "o_bias": bias, "sinks": True}


def reorder(loaded: dict, cfg) -> None:
    """Each layer's stacked experts (theirs: transposed, gate and up interleaved) in our layout:
    w13 [E, 2I, H] with the gate's rows over the up's, w2 [E, H, I], and their biases alike; MXFP4
    blocks (output-major already) as ggml's bytes, w13's rows likewise regrouped: w13_blocks and
    w2_blocks, set on the mixture as blocks (weights.py)."""
    for name in list(loaded):
        m = _EXPERTS.fullmatch(name)
        if m is None:
            continue
        prefix, what, bias = m.groups()
        if bias == "_blocks":
            _blocks(loaded, name, prefix, what)
            continue
        t = loaded.pop(name)
        if what == "gate_up_proj":
            t = t if bias else t.transpose(1, 2)             # [E, 2I(, H)], columns gate0 up0 gate1 up1...
            t = t.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)   # gates, then ups
            loaded[f"{prefix}w13{'_bias' if bias else ''}"] = t.contiguous()
        else:
            loaded[f"{prefix}w2{'_bias' if bias else ''}"] = t if bias else t.transpose(1, 2).contiguous()


def mxfp4_from_hf(blocks, scales):
    """MXFP4 weights from HF's layout (*_blocks uint8 [..., K/32, 16], element 2i in byte i's low
    nibble and 2i + 1 in its high one; *_scales uint8 [..., K/32], E8M0) as ggml's bytes
    [..., K/32 * 17]: the exponent, then byte i holding element i low and 16 + i high. The codes
    and exponents are the same numbers (ggml's values doubled, its scale halved): only moved.
    Tensor methods only: this file stays torch-free to import."""
    codes = blocks.new_empty(*blocks.shape[:-1], 32)   # [..., K/32, 32] in element order
    codes[..., 0::2], codes[..., 1::2] = blocks & 15, blocks >> 4
    raw = blocks.new_empty(*blocks.shape[:-1], 17)
    raw[..., 0], raw[..., 1:] = scales, codes[..., :16] | (codes[..., 16:] << 4)
    return raw.flatten(-2)


def _blocks(loaded: dict, name: str, prefix: str, what: str) -> None:
    """One MXFP4 stack (HF's *_blocks [E, N, K/32, 16] and *_scales [E, N, K/32]) as ggml's bytes
    [E N, K/32 * 17], gate_up's N regrouped as gates then ups (weights.py makes them blocks)."""
    scales = loaded.pop(name.replace("_blocks", "_scales"), None)
    if scales is None:
        raise ValueError(f"checkpoint has {name} without its {name.replace('_blocks', '_scales')}")
    raw = mxfp4_from_hf(loaded.pop(name), scales)   # [E, N, bytes]
    if what == "gate_up_proj":
        raw = raw.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)
    loaded[f"{prefix}{'w13' if what == 'gate_up_proj' else 'w2'}_blocks"] = raw.reshape(-1, raw.shape[-1]).contiguous()


# llama.cpp's names of a gpt-oss layer's tensors -> transformers' ("{}": weight or bias)
_GGUF_NAMES = (("attn_norm", "input_layernorm.weight"), ("post_attention_norm", "post_attention_layernorm.weight"),
               ("attn_q", "self_attn.q_proj.{}"), ("attn_k", "self_attn.k_proj.{}"), ("attn_v", "self_attn.v_proj.{}"),
               ("attn_output", "self_attn.o_proj.{}"), ("attn_sinks", "self_attn.sinks"),
               ("ffn_gate_inp", "mlp.router.{}"))


def gguf_experts(layer: int, parts: dict) -> dict:
    """A layer's experts as llama.cpp writes them (ffn_gate_exps / ffn_up_exps [E, I, H], ffn_down_exps
    [E, H, I], each with a bias) in transformers' layout: gate_up [E, H, 2I] with gate and up columns
    interleaved, down [E, I, H], biases likewise. Array methods only (this file imports no numpy)."""
    p = f"model.layers.{layer}.mlp.experts."
    gate_up = parts["ffn_gate_exps.weight"].repeat(2, axis=1)   # [E, 2I, H]: each gate row twice...
    gate_up[:, 1::2] = parts["ffn_up_exps.weight"]              # ...the second one the up's
    bias = parts["ffn_gate_exps.bias"].repeat(2, axis=1)
    bias[:, 1::2] = parts["ffn_up_exps.bias"]
    return {p + "gate_up_proj": gate_up.transpose(0, 2, 1).copy(), p + "gate_up_proj_bias": bias,
            p + "down_proj": parts["ffn_down_exps.weight"].transpose(0, 2, 1).copy(),
            p + "down_proj_bias": parts["ffn_down_exps.bias"].copy()}


def gguf_config(cfg: dict) -> dict:
    """llama.cpp's gpt-oss: every other layer windowed (the first one so), YaRN's ramp not rounded."""
    rope = {**cfg["rope_parameters"], "truncate": False} if "rope_parameters" in cfg else None
    return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(cfg["num_hidden_layers"])], **({"rope_parameters": rope} if rope else {})}


GPT_OSS = Family(architecture="GptOssForCausalLM", windows=LAYER_TYPES_ONLY, rope_theta=150_000.0,
                 stop_tokens=("<|return|>", "<|call|>"),   # harmony's: the answer's end, a tool call's
                 own_config=own_config, weights=WeightMapper(renames=(("router", "gate"),), reorder=reorder),
                 no_tensor_parallel="its attention sinks and expert biases are not sharded over ranks yet",
                 # transformers' GGUF reader has no gpt-oss: gguf_moe.py converts its files (MXFP4 experts run as they are)
                 gguf=GGUFArch("gpt-oss", experts=True, convert=True, expert_count_key="num_local_experts",
                               layer_names=_GGUF_NAMES, experts_to_hf=gguf_experts, own_config=gguf_config))
