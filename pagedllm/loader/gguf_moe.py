"""Mixtures of experts whose GGUF files transformers' reader does not convert (their families' GGUF
rows say `convert`: one it has no reader for, or one written under a dense architecture's name with
expert tensors, which it reads as the dense model and drops the experts). Converted here instead,
into what model_files.py makes of any GGUF file: an HF directory of float32 safetensors, config and
tokenizer.

- The config from the file's keys (`{arch}.block_count`, `.expert_count`, ...) and the family's row.
- Every tensor dequantized by gguf-py (the values transformers' reader gives the files it does
  read), named as transformers 5 holds them: a layer's experts stacked, gate_up [E, 2I, H] and
  down [E, H, I] (models/weights.py stack_experts takes that layout as it is).
- The q / k rows of the architectures llama.cpp permutes for its RoPE layout put back in HF's order
  (gguf_layout: PERMUTED_QK, unpermute_rows); the others keep HF's order (NeoX RoPE).
- The tokenizer through transformers' own GGUF tokenizer, from a copy of the file's tokenizer
  fields under an architecture its reader takes (the tokenizer does not depend on the model).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..models.registry import FAMILIES, gguf_model_type
from .gguf_layout import PERMUTED_QK, unpermute_rows

# per layer: GGUF name -> transformers' (stacked experts handled apart)
_LAYER = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
          "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
          "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
          "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
          "ffn_gate_inp": "mlp.gate.weight", "ffn_down_exps": "mlp.experts.down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
def convert(reader, name: str, out: Path, arch: str) -> None:
    """Write the model of the GGUF file `reader` has parsed (gguf.GGUFReader; `name` the file's, for
    errors) into the directory `out`: config.json, model.safetensors, the tokenizer."""
    from gguf.quants import dequantize

    cfg = _config(reader, arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    state: dict[str, torch.Tensor] = {}
    gate_up: dict[int, dict[str, np.ndarray]] = {}
    own = FAMILIES[cfg["model_type"]].gguf
    names = {**_LAYER, **dict(own.layer_names)}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name in _TOP:
            state[_TOP[t.name]] = torch.from_numpy(np.array(w))
            continue
        _, layer, kind, suffix = t.name.split(".", 3)
        if own.experts_to_hf is not None and kind.endswith("_exps"):   # the family lays them out
            gate_up.setdefault(int(layer), {})[f"{kind}.{suffix}"] = w
            continue
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            gate_up.setdefault(int(layer), {})[kind] = w
            continue
        if kind not in names:
            raise ValueError(f"model: {name}: tensor {t.name} ({arch}) is not one this converter knows")
        if arch in PERMUTED_QK and kind in ("attn_q", "attn_k"):   # llama.cpp's permute, undone
            w = w[unpermute_rows(w.shape[0], heads if kind == "attn_q" else kv_heads).numpy()]
        # "{}": the GGUF name's suffix (weight, bias) goes there
        state[f"model.layers.{layer}.{names[kind].format(suffix)}"] = torch.from_numpy(np.array(w))   # own, writable
    for layer, parts in gate_up.items():
        if own.experts_to_hf is not None:
            state.update({k: torch.from_numpy(v) for k, v in own.experts_to_hf(layer, parts).items()})
            continue
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.from_numpy(
            np.concatenate([parts["ffn_gate_exps"], parts["ffn_up_exps"]], axis=1))
    cfg["tie_word_embeddings"] = "lm_head.weight" not in state
    cfg["vocab_size"] = state["model.embed_tokens.weight"].shape[0]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _tokenizer(reader, out)


def _config(reader, arch: str) -> dict:
    def key(name: str, default=None):
        field = reader.fields.get(f"{arch}.{name}")
        return field.contents() if field is not None else default

    def token(name: str):
        field = reader.fields.get(f"tokenizer.ggml.{name}")
        return field.contents() if field is not None else None

    hidden, heads = key("embedding_length"), key("attention.head_count")
    width = key("expert_feed_forward_length") or key("feed_forward_length")
    common = dict(hidden_size=hidden, intermediate_size=width, num_hidden_layers=key("block_count"),
                  num_attention_heads=heads, num_key_value_heads=key("attention.head_count_kv", heads),
                  head_dim=key("attention.key_length", hidden // heads),
                  max_position_embeddings=key("context_length", 4096),
                  rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
                  rope_theta=key("rope.freq_base", 10000.0), num_experts_per_tok=key("expert_used_count"),
                  bos_token_id=token("bos_token_id"), eos_token_id=token("eos_token_id"), dtype="float32")
    model_type = gguf_model_type(arch, key("expert_count"))
    family = FAMILIES[model_type]
    if key("rope.scaling.type") == "yarn":
        common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": common.pop("rope_theta"),
                                     "factor": float(key("rope.scaling.factor")),
                                     "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                                     "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
                                     "original_max_position_embeddings": key("rope.scaling.original_context_length")}
    if key("attention.sliding_window"):
        common["sliding_window"] = key("attention.sliding_window")
    if family.gguf.own_config is not None:
        common.update(family.gguf.own_config(common))
    return {"model_type": model_type, "architectures": [family.architecture],
            family.gguf.expert_count_key: key("expert_count"), **dict(family.gguf.config), **common}


def _tokenizer(reader, out: Path) -> None:
    """transformers' tokenizer of the file's tokenizer.* fields, written into `out`."""
    import tempfile

    from gguf import GGUFValueType, GGUFWriter
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        header = Path(tmp) / "tokenizer.gguf"
        w = GGUFWriter(str(header), "llama")
        for name, f in reader.fields.items():
            if name.startswith("tokenizer."):
                w.add_key_value(name, f.contents(), f.types[0],
                                sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
        w.add_tensor("token_embd.weight", np.zeros((1, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        add_bos = reader.fields.get("tokenizer.ggml.add_bos_token")
        kw = {"add_bos_token": True} if add_bos is not None and add_bos.contents() else {}
        AutoTokenizer.from_pretrained(tmp, gguf_file=header.name, **kw).save_pretrained(out)
