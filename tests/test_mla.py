"""DeepSeek-V2 and -V3 (multi-head latent attention, models/mla.py): the pool keeps one latent row of
kv_lora_rank + qk_rope_head_dim values a token and layer, and decode attends to it with the
up-projections absorbed. Random weights of their layouts, built with transformers' own classes
(V2: no query compression, group-limited softmax routing; V3: a compressed query, sigmoid routing
with its choice bias; both: YaRN, shared experts, a dense first layer). Greedy tokens, prompt
logprobs, beams and prefix hits equal HF transformers' in float32; KV bytes per token are the
latent's; what the latent cannot do is refused by name."""
from __future__ import annotations

import pytest
import torch

from hf_random import PROMPTS, built, check_greedy_and_prompt_logprobs, check_prefix_hit, hf_tokens_of
from pagedllm import BeamSearchParams, SamplingParams
from test_beam_search import hf_beams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "rope_theta": 10000.0}
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=49152, intermediate_size=128,
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_hidden_layers=3,
              kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4,
              topk_group=2)
LATENT = 32 + 16   # kv_lora_rank + qk_rope_head_dim


def _config(family: str):
    import transformers as tf

    if family == "deepseek_v2":   # V2-Lite's kind: no q compression; V2's group-limited router
        return tf.DeepseekV2Config(**COMMON, q_lora_rank=None, topk_method="group_limited_greedy",
                                   routed_scaling_factor=1.5, rope_parameters={**YARN, "mscale": 0.707,
                                                                               "mscale_all_dim": 0.707})
    return tf.DeepseekV3Config(**COMMON, q_lora_rank=48, routed_scaling_factor=2.5, norm_topk_prob=True,
                               rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})


def build(family: str, tmp_path_factory, model_dir) -> tuple:
    """(HF model, its directory), made once per run; weights and the router's choice bias moved
    off their init so that every part (each norm, the bias, the rotary key) shows if dropped."""
    return built(family, lambda: _make(family), tmp_path_factory, model_dir)


def _make(family: str):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def deepseek(request, tmp_path_factory, model_dir):
    return build(request.param, tmp_path_factory, model_dir)


@pytest.fixture(scope="module")
def hf_tokens(deepseek):
    return hf_tokens_of(deepseek[0])


def test_greedy_and_logprobs_of_a_latent_pool_match_hf(make_llm, deepseek, hf_tokens, monkeypatch):
    """All eight at once (past YaRN's original 64 positions), prefills chunked at 48 tokens beside
    other sequences' decodes; the pool holds the latent alone. A prompt's first chunk runs on
    expanded heads, short chunks after keys in latent space, decodes on the latent kernel: each of
    them ran."""
    from pagedllm.attention import cpu_backend
    from pagedllm.models.mla import LatentAttention

    ran = {"fresh": 0, "latent": 0}

    def expanded(self, *args):
        for _, _, rows, keys in args[5]:
            ran["fresh"] += keys == rows
        return LatentAttention._expanded.__wrapped__(self, *args)

    def latent(*args):
        ran["latent"] += 1
        return latent.__wrapped__(*args)

    expanded.__wrapped__, latent.__wrapped__ = LatentAttention._expanded, cpu_backend.latent_prefill
    monkeypatch.setattr(LatentAttention, "_expanded", expanded)
    monkeypatch.setattr(cpu_backend, "latent_prefill", latent)
    hf, path = deepseek
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=48,
                   enable_prefix_caching=False)
    check_greedy_and_prompt_logprobs(llm, hf, hf_tokens)
    assert all(ran.values()), ran
    s = llm.engine.stats()
    assert s.bytes_per_token == 3 * LATENT * 4, "M_KV: L x (kv_lora_rank + rope dims) x 4 bytes, no V rows"
    assert llm.engine.kv.pool.num_used == 0


def test_a_long_prompt_chunked_attends_on_expanded_heads_over_its_pooled_keys(make_llm, deepseek, monkeypatch):
    """A 240-token prompt in chunks of 64 (a quarter of the step's budget): the first on full heads,
    the next two on full heads over the keys before them, up-projected from the latents read back
    from the pool, the 48-row tail after 192 keys in latent space (fewer flops there). Greedy
    tokens and prompt logprobs equal HF's."""
    from hf_greedy import hf_greedy
    from pagedllm.models.mla import LatentAttention

    after_keys = []

    def expanded(self, *args):
        after_keys.extend(keys for _, _, rows, keys in args[5] if keys > rows)
        return LatentAttention._expanded.__wrapped__(self, *args)

    expanded.__wrapped__ = LatentAttention._expanded
    monkeypatch.setattr(LatentAttention, "_expanded", expanded)
    hf, path = deepseek
    ids = [(7 * i * i + 3 * i) % 49000 + 100 for i in range(240)]
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=256,
                   enable_prefix_caching=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)
    assert sorted(set(after_keys)) == [128, 192], after_keys
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-3, rtol=0)


def test_a_prefix_hit_reads_the_cached_latent(make_llm, deepseek, hf_tokens):
    check_prefix_hit(make_llm(model=str(deepseek[1]), dtype="float32", kv_cache_memory="16MiB",
                              enable_prefix_caching=True), hf_tokens)


def test_beams_match_hf(make_llm, deepseek):
    hf, path = deepseek
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    ids = PROMPTS[5]
    out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=10))[0]
    want = hf_beams(hf, ids, 3, 10, [2])
    assert [s.tokens[len(ids):] for s in out.sequences] == [w for w, _ in want]
    for s, (_, score) in zip(out.sequences, want):
        assert s.score == pytest.approx(score, rel=1e-5, abs=1e-4)


def test_the_kv_report_shows_the_latent_and_what_expanding_it_would_cost(tmp_path_factory, model_dir):
    from pagedllm.engine.kv_report import kv_report
    from pagedllm.kv_dtype import KV_DTYPES
    from pagedllm.models import ModelConfig
    from pagedllm.loader import load_config

    path = build("deepseek_v3", tmp_path_factory, model_dir)[1]
    mc = ModelConfig.from_hf(load_config(path))
    assert mc.kv_bytes_per_token(KV_DTYPES["bfloat16"]) == 3 * LATENT * 2
    assert mc.mla.expanded(mc.num_heads) == 4 * (16 + 16 + 24)
    from pagedllm import LLM

    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB")
    text = kv_report(llm.engine.stats())
    assert "latent" in text and f"{3 * LATENT * 4} bytes/token" in text, text


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype int8 is not supported for deepseek_v3"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1 is not supported for deepseek_v3"),
    ({"enable_lora": True}, "enable_lora is not supported"),   # its experts refuse first; a dense MLA model its latent
])
def test_what_the_latent_cannot_do_is_refused_by_name(tmp_path_factory, model_dir, kwargs, match):
    from pagedllm import LLM

    path = build("deepseek_v3", tmp_path_factory, model_dir)[1]
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", **kwargs)


def test_a_backend_without_latent_attention_refuses_it_by_name():
    from pagedllm.attention import AttentionBackend

    class Plain(AttentionBackend):   # what the triton backend is: no forward_latent
        name = "plain"

    with pytest.raises(ValueError, match="attention backend plain does not run multi-head latent attention"):
        Plain.check_model(4, 1, LATENT, 0)


def test_a_router_we_do_not_compute_is_refused_by_name():
    from pagedllm.models import ModelConfig

    cfg = {**_config("deepseek_v3").to_dict(), "topk_method": "greedy"}
    with pytest.raises(ValueError, match="deepseek_v3: topk_method 'greedy' is not supported"):
        ModelConfig.from_hf(cfg)


def test_the_rotary_rows_are_reordered_exactly_in_bf16():
    """The loader's reorder of q's and the latent's rotary rows, on a bf16 checkpoint of V3's widths
    (128 heads x 192 rows of q): row indices past bf16's exact integers (256) must stay exact. Each
    row holds its own index as (index // 256, index % 256), both exact in bf16."""
    from pagedllm.models import ModelConfig
    from pagedllm.models.families.deepseek import reorder

    mc = ModelConfig.from_hf({**_config("deepseek_v3").to_dict(), "num_attention_heads": 128, "qk_nope_head_dim": 128,
                              "qk_rope_head_dim": 64, "kv_lora_rank": 512})

    def indexed(n: int) -> torch.Tensor:
        i = torch.arange(n)
        return torch.stack([i // 256, i % 256], dim=1).to(torch.bfloat16)

    def index(t: torch.Tensor) -> list[int]:
        return (t[:, 0].long() * 256 + t[:, 1].long()).tolist()

    loaded = {"layers.0.self_attn.q_b_proj.weight": indexed(128 * 192),
              "layers.0.self_attn.kv_a_proj_with_mqa.weight": indexed(576),
              f"layers.{mc.num_layers}.self_attn.o_proj.weight": torch.zeros(1)}   # a prediction layer past the last
    reorder(loaded, mc)
    rope = [128 + i for i in range(0, 64, 2)] + [128 + i for i in range(1, 64, 2)]   # evens, then odds
    head = 127 * 192   # the last head: its nope rows in place, its rotary rows reordered
    assert index(loaded["layers.0.self_attn.q_b_proj.weight"])[head:] == [head + i for i in list(range(128)) + rope]
    assert index(loaded["layers.0.self_attn.kv_a_proj_with_mqa.weight"]) == list(range(512)) + [384 + i for i in rope]
    assert f"layers.{mc.num_layers}.self_attn.o_proj.weight" not in loaded


def test_ngram_speculation_verifies_on_the_latent(make_llm, tmp_path_factory, model_dir):
    """Drafts are verified as short prefills over the latent and rolled back where rejected: the
    tokens are those of plain decoding."""
    path = build("deepseek_v3", tmp_path_factory, model_dir)[1]
    prompts = [[5, 17, 300, 4000, 12] * 6, list(range(100, 190))]   # the first repeats: n-grams to propose
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    spec = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB",
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.engine.stats().spec.num_draft_tokens > 0
    spec.engine.kv.check_integrity()
