"""gpt-oss (families/gpt_oss.py): attention sinks (a learned logit per head in every softmax),
windowed and full layers alternating, biases on q/k/v/o, a router with a bias, experts with
biases and a clamped SwiGLU; and its MXFP4 experts, from HF's layout, run as blocks. Random
weights of its layout built with transformers' own classes (YaRN past its original 64 positions,
windows of 16 tokens); greedy tokens, prompt logprobs, beams and prefix hits equal HF's in float32."""
from __future__ import annotations

import json

import pytest
import torch

from hf_random import PROMPTS, built, check_greedy_and_prompt_logprobs, check_prefix_hit, hf_tokens_of
from pagedllm import BeamSearchParams, SamplingParams
from test_beam_search import hf_beams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _make(vocab_size: int = 49152):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=vocab_size,
                          intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                          sliding_window=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                           "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                           "original_max_position_embeddings": 64})
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():   # every part off its init, so that each (a sink, a bias, a norm) shows if dropped
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "embed" not in name:
                p.normal_(0, 0.3 if ("sinks" in name or "bias" in name) else 0.08)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, model_dir):
    return built("gpt_oss", _make, tmp_path_factory, model_dir)


@pytest.fixture(scope="module")
def hf_tokens(gpt_oss):
    return hf_tokens_of(gpt_oss[0])


@pytest.fixture(scope="module")
def mxfp4(gpt_oss, tmp_path_factory):
    """(HF model with the experts transformers dequantizes from them, a checkpoint whose experts are
    random MXFP4 blocks and E8M0 scales in HF's layout, with quant_method mxfp4)."""
    import shutil

    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = gpt_oss[1]
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    shutil.copytree(src, out, dirs_exist_ok=True)
    state, g = load_file(src / "model.safetensors"), torch.Generator().manual_seed(5)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = state.pop(name).shape   # theirs is transposed: [E, K, N]
        state[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        state[name + "_scales"] = torch.randint(121, 125, (e, n, k // 32), generator=g, dtype=torch.uint8)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    ref = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name + "_blocks" in state:
                p.copy_(convert_moe_packed_tensors(state[name + "_blocks"], state[name + "_scales"], dtype=torch.float32))
    return ref, out


def test_greedy_and_logprobs_match_hf_on_the_compiled_kernels(make_llm, gpt_oss, hf_tokens):
    """All eight at once, prefills chunked at 48 tokens beside other sequences' decodes, past the
    16-token windows: the compiled attention with sinks, the compiled experts with biases."""
    hf, path = gpt_oss
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=48,
                   enable_prefix_caching=False, attention_backend="cpu")
    check_greedy_and_prompt_logprobs(llm, hf, hf_tokens)
    assert llm.engine.kv.pool.num_used == 0


def test_mxfp4_experts_run_as_blocks_and_match_transformers_dequantized(make_llm, mxfp4):
    """HF's MXFP4 layout read as ggml's blocks (never dequantized whole) equals transformers' own
    dequantization of them, here under the torch attention backend's sinks."""
    ref, path = mxfp4
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=48,
                   enable_prefix_caching=False, attention_backend="torch")
    moe = llm.engine.runner.model.layers[0].mlp
    assert moe.quantized and moe.w13_format == moe.w2_format == "MXFP4"
    from pagedllm.kernels import load_ops
    assert moe.interleaved == load_ops().moe_can_w8a8(), "repacked for the int8 kernel where the CPU has VNNI"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens_of(ref)


def test_a_prefix_hit_and_beams_match_hf(make_llm, gpt_oss, hf_tokens):
    hf, path = gpt_oss
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", enable_prefix_caching=True)
    check_prefix_hit(llm, hf_tokens)
    ids = PROMPTS[5]
    out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=10))[0]
    want = hf_beams(hf, ids, 3, 10, [2])
    assert [s.tokens[len(ids):] for s in out.sequences] == [w for w, _ in want]


def test_a_gguf_file_runs_its_mxfp4_experts_as_they_are(make_llm, tmp_path):
    """A GGUF file as llama.cpp writes gpt-oss (experts split into gate / up / down with biases,
    MXFP4; sinks, router and biases F32; windows and YaRN as keys): the engine runs the file's
    MXFP4 bytes and gives the greedy tokens of transformers' model of the file's conversion, which
    holds the original's exact values but for the experts' MXFP4 rounding."""
    import transformers as tf
    from benchmarks.lib.gguf_files import write_gguf
    from hf_greedy import assert_greedy_matches

    model = _make(vocab_size=260)   # the tiny byte-level tokenizer's
    path = write_gguf(model, tmp_path / "tiny-gpt-oss.gguf", "gpt-oss", "F32", None, expert_quant="MXFP4")
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", quantization="gguf")
    moe = llm.engine.runner.model.layers[0].mlp
    assert llm.engine.model_cfg.model_type == "gpt_oss" and moe.w13_format == moe.w2_format == "MXFP4"
    hf = tf.AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    assert hf.config.layer_types == model.config.layer_types and hf.config.sliding_window == 16
    theirs = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        if ".experts." in name and "bias" not in name:   # MXFP4: within a third of its block's largest value
            block_max = theirs[name].abs().unflatten(1, (-1, 32)).amax(2, keepdim=True)   # blocks of 32 along K
            assert ((p - theirs[name]).abs().unflatten(1, (-1, 32)) <= block_max / 3 + 1e-6).all(), name
        else:
            assert torch.equal(p, theirs[name]), name
    assert_greedy_matches(llm, hf, [[5, 17, 200, 250, 12], list(range(100, 160))], 12)


@pytest.mark.parametrize("change, kwargs, match", [
    ({}, {"tensor_parallel_size": 2}, "tensor_parallel_size > 1 is not supported for gpt_oss"),
    ({"quantization_config": {"quant_method": "awq"}}, {}, "quant_method 'awq' is not supported"),
])
def test_what_gpt_oss_cannot_do_is_refused_by_name(gpt_oss, tmp_path, change, kwargs, match):
    import shutil

    from pagedllm import LLM

    path = shutil.copytree(gpt_oss[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", **kwargs)
