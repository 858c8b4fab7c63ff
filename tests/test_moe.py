"""Mixtures of experts (models/moe.py): Qwen3-MoE, Qwen2-MoE (its shared expert), OLMoE (its
whole-projection QK-norm) and Mixtral (its own module names), each a tiny random model of 16
experts made with transformers' own class: greedy tokens equal HF transformers', prompt
logprobs agree within float rounding, on the compiled kernel (one call a layer) and on the
torch path; the kernel against torch on routing with ties and experts no row chose."""
from __future__ import annotations

import shutil

import pytest
import torch

from pagedllm import SamplingParams

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)


def _config(family: str):
    import transformers as tf

    if family == "qwen3_moe":   # the first layer dense (mlp_only_layers), top-4 of 16, renormalized
        return tf.Qwen3MoeConfig(**BASE, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                 num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0])
    if family == "qwen2_moe":   # a shared expert beside the routed ones, not renormalized
        return tf.Qwen2MoeConfig(**BASE, intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=16, num_experts_per_tok=4,
                                 norm_topk_prob=False)
    if family == "olmoe":
        return tf.OlmoeConfig(**BASE, intermediate_size=32, num_experts=16, num_experts_per_tok=4)
    if family == "mixtral":
        return tf.MixtralConfig(**BASE, intermediate_size=48, num_local_experts=16, num_experts_per_tok=2,
                                sliding_window=None)
    raise AssertionError(family)


def make_model(tmp_path, model_dir, family: str):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family)).eval()
    with torch.no_grad():   # norms and the router away from their init, so a slip would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    out = tmp_path / family
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)
    return model, out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_moe_family_matches_hf(make_llm, tmp_path, model_dir, family, monkeypatch):
    hf, path = make_model(tmp_path, model_dir, family)
    prompts = [[5, 17, 300, 4000, 12], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    want, refs = [], []
    for ids in prompts:
        with torch.no_grad():
            want.append(hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist())
            refs.append(torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1))
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    assert llm.engine.runner.model.layers[1].mlp.w13.shape[0] == 16
    from pagedllm.analysis.kv_calc import param_count   # kv-calc's weights: the checkpoint's, every expert
    assert param_count(llm.engine.model_cfg) == sum(p.numel() for p in hf.parameters())
    assert param_count(llm.engine.model_cfg, active=True) < param_count(llm.engine.model_cfg)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out, w, ref in zip(prompts, outs, want, refs):
        assert out.outputs[0].token_ids == w
        got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_layer_equals_torch(dtype):
    """kernels/csrc/moe.cpp against the torch grouping: 37 rows, top-3 of 8 experts with two
    experts no row chose, ties in the router's scores, SiLU and GELU gates, and a decode-sized
    batch (the experts spread over the threads)."""
    from pagedllm.kernels import load_ops
    from pagedllm.models.llama import Ops
    from pagedllm.models.moe import experts_torch

    class Experts:
        num_experts, activation = 8, "silu"

    g = torch.Generator().manual_seed(0)
    moe = Experts()
    moe.w13 = (torch.randn(8, 2 * 48, 64, generator=g) / 8).to(dtype)
    moe.w2 = (torch.randn(8, 64, 48, generator=g) / 8).to(dtype)
    ops = Ops(load_ops())
    for t, act in ((37, "silu"), (3, "gelu_tanh")):
        moe.activation = act
        x = torch.randn(t, 64, generator=g).to(dtype)
        experts = torch.randint(0, 6, (t, 3), generator=g)   # experts 6 and 7: chosen by no row
        weights = torch.rand(t, 3, generator=g)
        weights[0] = 1 / 3   # a tie
        want = experts_torch(moe, x, weights, experts, ops.act_mul)
        got = ops.experts(moe, x, weights, experts)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_moe_refusals(make_llm, tmp_path, model_dir):
    """What a mixture of experts does not run yet is refused naming it; a missing expert
    tensor fails the load naming the tensor."""
    from safetensors.torch import load_file, save_file

    _, path = make_model(tmp_path, model_dir, "qwen3_moe")
    with pytest.raises(ValueError, match="expert parallelism, which is not built"):
        make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)
    for bad, why in (({"quantization": "int8"}, "quantization 'int8' is not supported with a mixture of experts"),
                     ({"enable_lora": True}, "enable_lora is not supported with a mixture of experts")):
        with pytest.raises(ValueError, match=why):
            make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", **bad)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks layers\.1\.mlp\.experts\.7\.up_proj\.weight"):
        make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")
