"""Qwen3, Phi-3 and LFM2 from GGUF files (benchmarks/lib/gguf_files.py writes them as llama.cpp's converter lays
them out: Phi-3's attn_qkv and ffn_up fused, Qwen3's QK-norms, LFM2's short convolutions and per-layer KV
heads): the engine runs the file's own blocks
(quantization="gguf", no matmul left on float weights; its norms and config through the file's
conversion, transformers' own read of it) and gives the greedy tokens of transformers' model read
from the same file."""
from __future__ import annotations

import pytest
import torch
from hf_greedy import assert_greedy_matches

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=260,   # a byte-level tokenizer
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


def _config(arch: str):
    import transformers as tf

    if arch == "lfm2":   # convolution, attention, convolution: the file's KV heads per layer say which
        return tf.Lfm2Config(**{**TINY, "num_hidden_layers": 3}, num_attention_heads=2, num_key_value_heads=1,
                             conv_L_cache=3, block_multiple_of=32, layer_types=["conv", "full_attention", "conv"])
    if arch == "qwen3":  # transformers reads no head_dim from a GGUF: Qwen3's default, 128
        return tf.Qwen3Config(**TINY, num_attention_heads=2, num_key_value_heads=1, head_dim=128, rope_theta=1e6)
    return tf.Phi3Config(**{**TINY, "hidden_size": 256}, num_attention_heads=2, num_key_value_heads=1,
                         pad_token_id=0, rope_theta=10000.0)


@pytest.fixture(params=[("qwen3", "Q8_0"), ("phi3", "Q4_0"), ("lfm2", "Q8_0")], ids=lambda p: "-".join(p))
def gguf_file(request, tmp_path):
    import transformers as tf
    from benchmarks.lib.gguf_files import write_gguf

    arch, quant = request.param
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(arch)).eval()
    with torch.no_grad():  # norms away from 1: a dropped one would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "conv.conv" in name:   # LFM2's taps: away from the init's small values
                p.normal_(0, 0.5)
    return arch, write_gguf(model, tmp_path / f"tiny-{arch}.gguf", arch, quant, None)


def test_gguf_file_matches_transformers(make_llm, gguf_file):
    from transformers import AutoModelForCausalLM

    arch, path = gguf_file
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", quantization="gguf")
    assert llm.engine.model_cfg.model_type == arch
    summary = llm.engine.runner.model.quant_summary
    assert "float" not in summary and "on" in summary, summary
    # transformers' from_pretrained(gguf_file=...) of the file, as the engine's conversion saved it
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    assert_greedy_matches(llm, hf, [[5, 17, 200, 250, 12], list(range(100, 160))], 12)
