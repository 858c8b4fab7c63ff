"""Other Llama-family layouts, loaded from an HF model directory (config.json +
safetensors): Qwen2 (qkv bias), untied embeddings, Llama 3 RoPE scaling, Mistral.
Tiny random weights; greedy tokens must equal HF transformers'."""
from __future__ import annotations

import shutil

import pytest
import torch

from pagedllm import SamplingParams

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2)


def make_model(tmp_path, model_dir, family: str):
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen2":
        cfg = tf.Qwen2Config(**BASE, tie_word_embeddings=False, rope_theta=1e6)
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "mistral":
        cfg = tf.MistralConfig(**BASE, tie_word_embeddings=False, sliding_window=None)
        model = tf.MistralForCausalLM(cfg)
    else:
        cfg = tf.LlamaConfig(**BASE, tie_word_embeddings=True, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():  # make qkv biases non-zero, so a dropped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    out = tmp_path / family
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)  # any tokenizer with the same vocabulary will do
    return model.eval(), out


@pytest.mark.parametrize("family", ["qwen2", "llama3-scaled", "mistral"])
def test_family_matches_hf(make_llm, tmp_path, model_dir, family):
    hf, path = make_model(tmp_path, model_dir, family)
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    prompts = [[5, 17, 300, 4000, 12], list(range(100, 190))]  # the second crosses the scaled-RoPE range
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == want
