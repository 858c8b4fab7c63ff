"""Every family the one decoder runs, loaded from an HF model directory (config.json +
safetensors) of tiny random weights built here with transformers' own classes: greedy tokens
equal HF transformers', and prompt logprobs agree within float rounding. Each config turns on
what its family adds: Qwen2's qkv bias, Llama 3's and YaRN's RoPE scaling, Mistral, Qwen3's
QK-norm, SmolLM3's NoPE layers, Phi-3's fused checkpoint, partial rotary and LongRoPE, and
Gemma 3's sandwich norms, (1 + w) norms, scaled embeddings, GELU gate, query scale, and its
windowed layers on their own RoPE base."""
from __future__ import annotations

import shutil

import pytest
import torch

import hf_memo

from pagedllm import SamplingParams

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2)
# Phi-4-mini's heads: 128 dims, 96 of them turned (the compiled RoPE takes multiples of 32).
WIDE = {**BASE, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}


def _config(family: str):
    import transformers as tf

    if family == "qwen2":
        return tf.Qwen2Config(**BASE, tie_word_embeddings=False, rope_theta=1e6)
    if family == "mistral":
        return tf.MistralConfig(**BASE, tie_word_embeddings=False, sliding_window=None)
    if family == "llama3-scaled":
        return tf.LlamaConfig(**BASE, tie_word_embeddings=True, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "llama-yarn":
        return tf.LlamaConfig(**BASE, rope_theta=10000.0, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    if family == "qwen3":
        return tf.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)
    if family == "smollm3":
        return tf.SmolLM3Config(**BASE, pad_token_id=0, no_rope_layer_interval=2)  # layer 1 has no RoPE
    if family == "phi3":
        # Phi-4-mini's RoPE: 3/4 of each head turned, LongRoPE's short factors below the original
        # context (its long ones past it; see rope.py) and their attention factor.
        rot = 96
        return tf.Phi3Config(**{**WIDE, "max_position_embeddings": 1024}, tie_word_embeddings=True,
                             original_max_position_embeddings=256, rope_parameters={
                                 "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0 + 0.05 * i for i in range(rot // 2)],
                                 "long_factor": [2.0 + 0.1 * i for i in range(rot // 2)]})
    if family == "gemma3":
        return tf.Gemma3TextConfig(**BASE, head_dim=32, query_pre_attn_scalar=24, sliding_window=48,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    raise AssertionError(family)


FAMILIES = ["qwen2", "llama3-scaled", "mistral", "llama-yarn", "qwen3", "smollm3", "phi3", "gemma3"]


def make_model(tmp_path, model_dir, family: str):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family)).eval()
    with torch.no_grad():  # biases and norms away from their init, so a dropped one would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    out = tmp_path / family
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)  # any tokenizer with the same vocabulary will do
    return model, out


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf(make_llm, tmp_path, model_dir, family):
    hf, path = make_model(tmp_path, model_dir, family)
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    prompts = [[5, 17, 300, 4000, 12], list(range(100, 190))]  # the second crosses the scaled-RoPE range and windows
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf_memo.generate(hf, torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert out.outputs[0].token_ids == want
        got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-3, rtol=0)


def test_chat_template_from_a_file_or_inline(model_dir, tmp_path):
    """--chat-template (vLLM's): a Jinja file's path or the template itself replaces the
    tokenizer's own; anything else is refused naming the flag."""
    from pagedllm.loader.model_files import load_tokenizer

    msgs = [{"role": "user", "content": "hi"}]
    inline = load_tokenizer(model_dir, "[{{ messages[0]['content'] }}]")
    assert inline.apply_chat_template(msgs, tokenize=False) == "[hi]"
    (tmp_path / "t.jinja").write_text("<{{ messages[0]['content'] }}>")
    assert load_tokenizer(model_dir, str(tmp_path / "t.jinja")).apply_chat_template(msgs, tokenize=False) == "<hi>"
    assert "<|im_start|>" in load_tokenizer(model_dir).apply_chat_template(msgs, tokenize=False)  # its own
    with pytest.raises(ValueError, match="chat_template: 'no-such-file' is neither a file nor a Jinja template"):
        load_tokenizer(model_dir, "no-such-file")
