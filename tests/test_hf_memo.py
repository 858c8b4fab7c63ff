"""hf_memo, the tests' disk cache of HF transformers' generate(): a second call reads what the
first computed, and anything that can change the tokens (a weight written in place, the config,
an argument, an adapter's scaling) is another key, computed afresh."""
from __future__ import annotations

import pytest
import torch

import hf_memo


@pytest.fixture
def model(tmp_path, monkeypatch):
    import transformers as tf

    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_TEST_HF_FRESH", raising=False)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    return tf.LlamaForCausalLM(cfg).eval()


def counted(model) -> list[int]:
    """Counts the model's real generate() calls."""
    calls = [0]
    real = model.generate

    def generate(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)
    model.generate = generate
    return calls


GREEDY = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


def test_a_second_call_reads_the_first_and_a_change_computes_again(model, tmp_path, monkeypatch):
    calls = counted(model)
    ids = torch.tensor([[5, 6, 7]])
    first = hf_memo.generate(model, ids, **GREEDY)
    assert torch.equal(hf_memo.generate(model, ids, **GREEDY), first) and calls[0] == 1
    assert len(list(tmp_path.glob("hf-references/*/*.json"))) == 1
    hf_memo.generate(model, ids, **{**GREEDY, "max_new_tokens": 5, "min_new_tokens": 5})   # an argument
    hf_memo.generate(model, torch.tensor([[5, 6, 8]]), **GREEDY)   # the inputs
    assert calls[0] == 3
    with torch.no_grad():
        model.lm_head.weight.mul_(2)   # in place: the digest sees the version counter move
    hf_memo.generate(model, ids, **GREEDY)
    model.config.rope_theta = 500.0
    hf_memo.generate(model, ids, **GREEDY)
    assert calls[0] == 5
    model.config._name_or_path = "/tmp/pytest-of-someone/pytest-7/model0"   # where it was loaded from: the same model
    hf_memo.generate(model, ids, **GREEDY)
    assert calls[0] == 5
    monkeypatch.setenv("PAGEDLLM_TEST_HF_FRESH", "1")
    hf_memo.generate(model, ids, **GREEDY)
    assert calls[0] == 6


def test_beam_scores_come_back_exactly_and_a_torn_file_is_computed_again(model, tmp_path):
    calls = counted(model)
    kw = dict(num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=4, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    ids = torch.tensor([[9, 10, 11, 12]])
    a, b = hf_memo.generate(model, ids, **kw), hf_memo.generate(model, ids, **kw)
    assert torch.equal(a.sequences, b.sequences) and a.sequences_scores.tolist() == b.sequences_scores.tolist()
    (path,) = tmp_path.glob("hf-references/*/*.json")
    path.write_text('{"sequences": [[1, 2')
    assert torch.equal(hf_memo.generate(model, ids, **kw).sequences, a.sequences) and calls[0] == 2


def test_an_adapters_scaling_is_in_the_key(model):
    from peft import LoraConfig, get_peft_model

    ids = torch.tensor([[5, 6, 7]])
    keys = set()
    for alpha in (8, 16):   # the same weights, another scaling: other tokens, so another key
        torch.manual_seed(1)
        peft = get_peft_model(type(model)(model.config).eval(), LoraConfig(r=4, lora_alpha=alpha,
                                                                           target_modules=["q_proj"]))
        keys.add(hf_memo._key(peft, ids, GREEDY))
    assert len(keys) == 2
