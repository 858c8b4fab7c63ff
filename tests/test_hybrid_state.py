"""Hybrid models whose layers keep a recurrent state in the KV pool (kv.groups' STATE blocks):
LFM2's gated short convolutions, Granite 4.0-H's Mamba-2 layers and Qwen3-Next's gated DeltaNet
layers beside their attention layers, random weights of their real layouts built with transformers' own classes. Greedy
tokens, prompt logprobs and beams equal HF transformers' in float32 through chunked prefill and
continuous batching; a prefix hit restarts from the state cached at a block's end and gives the
same text as no cache, from the pool, from the disk tier after a restart, and from Redis on another
replica; what the state cannot do (speculation, reserve-max's one table, quantized KV) is refused
by name."""
from __future__ import annotations

import pytest
import torch

from hf_greedy import hf_greedy
from hf_random import PROMPTS, built, check_greedy_and_prompt_logprobs, hf_tokens_of
from test_beam_search import hf_beams

from pagedllm import BeamSearchParams, SamplingParams
from pagedllm.analysis.kv_calc import kv_calc, param_count

BLOCK = 32   # Granite's SSM state (4 heads x 32 x 8) fills a block's V rows of 32 tokens, as Qwen3-Next's and
# Nemotron-H's (4 x 16 x 16)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(family: str):
    import transformers as tf

    if family == "lfm2":   # LFM2-350M's pattern: convolutions, an attention layer among them
        return tf.Lfm2Config(**COMMON, intermediate_size=192, num_hidden_layers=6, conv_L_cache=3, block_multiple_of=32,
                             layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"])
    if family == "qwen3_next":   # gated DeltaNet layers (2 key heads, 4 value heads), a gated attention layer, experts
        return tf.Qwen3NextConfig(**COMMON, head_dim=16, num_hidden_layers=4, intermediate_size=96,
                                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                  linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "nemotron_h":   # Mamba-2 blocks (two groups of heads, its norm by group), NoPE attention, ReLU^2 MLP blocks;
        # state_size 16 and groups of 32 channels: the compiled kernels' path (the other families' tests run torch's).
        # time_step_min ~0: transformers' prefill clamps dt below at it (its decode, NVIDIA's code and vLLM do not; ours
        # takes time_step_limit, (0, inf)), and these weights put some dt under the default 0.001
        return tf.NemotronHConfig(**COMMON, head_dim=16, intermediate_size=96, mamba_num_heads=4, mamba_head_dim=16,
                                  n_groups=2, ssm_state_size=16, conv_kernel=4, time_step_min=1e-9,
                                  layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                                                     "linear_attention", "mlp", "mlp"])
    # Granite 4.0-H-Micro's kind: Mamba-2 layers (two groups of heads), NoPE attention, its scalars;
    # granite_moe: -Tiny's kind, experts in every layer beside the shared MLP
    return tf.GraniteMoeHybridConfig(**COMMON, num_hidden_layers=4, shared_intermediate_size=96,
                                     **(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
                                        if family == "granite_moe" else dict(num_local_experts=0)),
                                     layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4,
                                     mamba_n_groups=2, mamba_d_state=8, mamba_d_head=32, mamba_d_conv=4,
                                     embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                     logits_scaling=2.0)


def build(family: str, tmp_path_factory, model_dir) -> tuple:
    """(HF model, its directory), made once per run: weights scaled up from the init so that each
    layer moves the residual stream (with the init's, every token repeats its input)."""
    return built(family, lambda: _make(family), tmp_path_factory, model_dir)


def _make(family: str):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name and p.dim() == 3:
                p.normal_(0, 0.5)
            elif "norm" in name or name.endswith(("A_log", "D", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
            elif p.dim() == 2 and "embed" not in name:
                p.mul_(6)
    return model


@pytest.fixture(scope="module", params=["lfm2", "granitemoehybrid", "qwen3_next", "nemotron_h"])
def hybrid(request, tmp_path_factory, model_dir):
    return build(request.param, tmp_path_factory, model_dir)


@pytest.fixture(scope="module")
def hf_tokens(hybrid):
    return hf_tokens_of(hybrid[0])


def test_greedy_and_prompt_logprobs_match_hf_through_chunks_and_batches(make_llm, hybrid, hf_tokens):
    """All eight at once, prefills chunked at 48 tokens beside other sequences' decodes."""
    hf, path = hybrid
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=48,
                   enable_prefix_caching=False, block_size=BLOCK)
    kinds = [g.kind for g in llm.engine.kv.stats().groups]
    assert kinds[0] == "full" and set(kinds[1:]) == {"state"}, "attention first, then its state layers' groups"
    calc = kv_calc(llm.engine.model_cfg, "float32", block_size=BLOCK, budget_bytes=16 * 2**20)
    assert (calc.groups, calc.bytes_per_block, calc.num_blocks) == \
        (tuple(kinds), llm.engine.runner.bytes_per_block, llm.get_stats().kv.num_blocks), "kv-calc counts this pool"
    assert param_count(llm.engine.model_cfg) == sum(p.numel() for p in hf.parameters()), "and these weights"
    check_greedy_and_prompt_logprobs(llm, hf, hf_tokens)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used == 0, "every state block went back"


def test_preempted_sequences_recompute_their_state(make_llm, hybrid, hf_tokens):
    """A pool too small for all eight: sequences are preempted, their state blocks freed with
    their K/V, and recomputed (from a cached snapshot where one survived) to HF's tokens."""
    llm = make_llm(model=str(hybrid[1]), dtype="float32", num_gpu_blocks_override=24, max_model_len=512,
                   max_num_batched_tokens=64, block_size=BLOCK)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert llm.engine.stats().preemptions > 0
    llm.engine.kv.check_integrity()


def test_a_prefix_hit_restarts_from_the_cached_state(make_llm, hybrid, hf_tokens):
    """The second prompt of a shared stem finds its first two blocks cached: the attention group
    their K/V, the state group the state after token 63 alone. Its text is HF's, computed
    from scratch; a hit from a wrong state would change it."""
    llm = make_llm(model=str(hybrid[1]), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK,
                   enable_prefix_caching=True)
    kv = llm.engine.kv
    assert llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_tokens[2]
    before = kv.prefix_hits
    assert llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_tokens[3]
    assert kv.prefix_hits - before == 2 * BLOCK
    # a whole chat's turn later: its own history is cached, state and all, at every block end it crossed
    first = PROMPTS[2] + hf_tokens[2]
    follow = first[:3 * BLOCK] + [5, 6]   # its third block ends in tokens it generated
    before = kv.prefix_hits
    assert llm.generate([follow], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hybrid[0], follow, 32)
    assert kv.prefix_hits - before == 3 * BLOCK
    kv.check_integrity()


def test_granite_with_experts_matches_hf(make_llm, tmp_path_factory, model_dir):
    """Granite 4.0-H-Tiny's kind: a mixture in every layer (its router a softmax over the top k's
    logits) beside the ungated shared MLP, the experts stacked in the checkpoint as theirs: HF's
    tokens and prompt logprobs through chunks and batches, and again through a prefix hit."""
    hf, path = build("granite_moe", tmp_path_factory, model_dir)
    tokens = hf_tokens_of(hf)
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=48,
                   block_size=BLOCK, enable_prefix_caching=True)
    assert llm.engine.runner.model_cfg.moe.shared_width == 96
    check_greedy_and_prompt_logprobs(llm, hf, tokens)
    before = llm.engine.kv.prefix_hits
    assert llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens[3]
    assert llm.engine.kv.prefix_hits - before >= 2 * BLOCK
    llm.engine.kv.check_integrity()


def test_nemotron_h_reads_nvidia_s_checkpoint_layout(make_llm, tmp_path_factory, model_dir, tmp_path):
    """The files NVIDIA published: the blocks named by hybrid_override_pattern beside num_hidden_layers,
    the tensors under backbone. rather than model.: read as transformers' own layout, HF's tokens."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    hf, path = build("nemotron_h", tmp_path_factory, model_dir)
    nvidia = tmp_path / "nvidia"
    shutil.copytree(path, nvidia)
    cfg = json.loads((nvidia / "config.json").read_text())
    symbol = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    blocks = cfg.pop("layers_block_type")
    cfg.update(hybrid_override_pattern="".join(symbol[b] for b in blocks), num_hidden_layers=len(blocks))
    (nvidia / "config.json").write_text(json.dumps(cfg))
    weights = load_file(nvidia / "model.safetensors")
    save_file({k.replace("model.", "backbone.", 1): v for k, v in weights.items()}, nvidia / "model.safetensors")
    llm = make_llm(model=str(nvidia), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK)
    outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens_of(hf)[:3]


# PEFT's names for every matmul of a family's layers: attention's, the state mixer's own, the MLP's
LORA_TARGETS = {"lfm2": ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"],
                "granitemoehybrid": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear",
                                     "output_linear"]}


def test_a_lora_adapter_on_every_matmul_gives_peft_s_tokens(make_llm, hybrid, hf_tokens, tmp_path):
    """A PEFT adapter on each matmul of the layers, the state mixers' included (LFM2's conv
    in_proj / out_proj, Granite's Mamba in_proj / out_proj), run unmerged from the KV pool's pages:
    the tokens of PEFT's merged model, not the base's. Qwen3-Next's mixture of experts and
    Nemotron-H's MLP blocks refuse adapters by name."""
    import copy

    from peft import LoraConfig, get_peft_model

    from pagedllm import LLM
    from pagedllm.lora import LoRARequest

    hf, path = hybrid
    family = hf.config.model_type
    if family not in LORA_TARGETS:
        why = {"qwen3_next": "enable_lora is not supported with a mixture of experts",
               "nemotron_h": "enable_lora is not supported for nemotron_h: adapters do not reach the MLP blocks"}
        with pytest.raises(ValueError, match=why[family]):
            LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK, enable_lora=True)
        return
    torch.manual_seed(3)
    peft = get_peft_model(copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS[family],
                                                        init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft.save_pretrained(tmp_path / "adapter")
    merged = peft.merge_and_unload().eval()
    prompts = PROMPTS[:4]
    want = [hf_greedy(merged, ids, 16) for ids in prompts]
    assert want != [t[:16] for t in hf_tokens[:4]], "the adapter must move the tokens"
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK, enable_lora=True,
                   max_lora_rank=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.engine.kv.check_integrity()


def test_beams_fork_the_state_as_hf(make_llm, hybrid):
    """Beams share their parent's state block and copy it before writing their own token."""
    hf, path = hybrid
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK)
    for ids in (PROMPTS[0], PROMPTS[5]):
        out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=10))[0]
        want = hf_beams(hf, ids, 3, 10, [2])
        assert [s.tokens[len(ids):] for s in out.sequences] == [w for w, _ in want]
        for s, (_, score) in zip(out.sequences, want):
            assert s.score == pytest.approx(score, rel=1e-5, abs=1e-4)
    assert llm.engine.kv.stats().cow_copies > 0


def _tiered(path, **kw):
    from pagedllm import LLM

    return LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK, **kw)


def test_the_disk_tier_keeps_the_state_across_a_restart(hybrid, hf_tokens, tmp_path):
    """Engine A computes a prompt and writes its blocks through to disk, every group's under its
    own keys; engine B, a fresh pool on the same folder, loads the attention layers' blocks and
    the state at the last full block the next prompt shares, and computes the rest: HF's text,
    so the state it restarted from was the prefix's."""
    a = _tiered(hybrid[1], kv_offload_dir=str(tmp_path))
    assert a.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_tokens[2]
    a.engine.kv.connector.store.flush()
    a.close()
    b = _tiered(hybrid[1], kv_offload_dir=str(tmp_path))
    kv = b.engine.kv
    assert b.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_tokens[3]
    f = kv.connector.figures()
    assert f.hits == 2 * BLOCK and f.store.read_failures == 0
    # the shared two blocks of each group that reads them: all of a full group's, the last of a state group's
    want = sum(2 if g.holds == "kv" else 1 for g in kv.groups)
    assert f.loaded_blocks == want, (f.loaded_blocks, [g.kind for g in kv.groups])
    kv.check_integrity()
    b.close()


def test_swap_preemption_saves_the_state_to_the_tier(hybrid, hf_tokens, tmp_path):
    """A pool too small for all eight, preempting by swap: a victim's full blocks of every
    group, its state snapshots among them, go to the tier and come back on resume."""
    llm = _tiered(hybrid[1], kv_offload_dir=str(tmp_path), num_gpu_blocks_override=24, max_model_len=512,
                  max_num_batched_tokens=64, preemption_mode="swap", kv_offload_write_policy="write_back")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    f = llm.engine.kv.connector.figures()
    assert f.swap_outs > 0 and f.swap_out_blocks > 0 and f.loaded_blocks > 0
    llm.engine.kv.check_integrity()
    llm.close()


def test_a_replica_takes_the_state_from_redis(tmp_path_factory, model_dir):
    """The shared tier: what replica A computed of a Qwen3-Next prompt, replica B (its own pool)
    reads from Redis, state blocks and attention blocks, to the same text as computing it."""
    from benchmarks.lib.redis_server import RedisServer

    try:
        server = RedisServer(maxmemory="256mb")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        path = build("qwen3_next", tmp_path_factory, model_dir)[1]
        a = _tiered(path, kv_offload_url=server.url)
        want = a.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        a.engine.kv.connector.store.flush()
        a.close()
        b = _tiered(path, kv_offload_url=server.url)
        assert b.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        kv = b.engine.kv
        f = kv.connector.figures()
        full = (len(PROMPTS[2]) - 1) // BLOCK
        assert f.hits == full * BLOCK and f.store.read_failures == 0
        assert f.loaded_blocks == sum(full if g.holds == "kv" else 1 for g in kv.groups)
        b.close()
    finally:
        server.stop()


@pytest.mark.parametrize("kwargs, match", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
     "speculative decoding is not supported for lfm2"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype int8 is not supported for lfm2"),
    ({"quantization": "w8a8"}, "quantization w8a8 is not supported for lfm2"),
    ({"allocation": "reserve-max"}, "reserve-max reserves one table, which a model whose layers keep a recurrent state"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1 is not supported for lfm2"),
])
def test_what_a_state_cannot_do_is_refused_by_name(tmp_path_factory, model_dir, kwargs, match):
    """The runner's refusals, whatever the state layer: checked on one family."""
    from pagedllm import LLM

    path = build("lfm2", tmp_path_factory, model_dir)[1]
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK, **kwargs)


def test_a_block_too_small_for_the_state_names_the_size_it_needs(tmp_path_factory, model_dir):
    from pagedllm import LLM

    path = build("granitemoehybrid", tmp_path_factory, model_dir)[1]   # LFM2's state fits any block
    with pytest.raises(ValueError, match="block_size 16 is too small for granitemoehybrid's state .* use block_size >= 32"):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=16)
