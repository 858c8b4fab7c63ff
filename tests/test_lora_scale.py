"""Many adapters in one pool (issue 40's scale target): 500 rank-8 adapters on disk, 64 requests
over 64 of them at once, in a pool that holds the pages of a few: every request completes with
the tokens it gets alone, adapters wait for room, are evicted and paged in again, and no block
leaks. And the same paging on each rank of a tensor-parallel group (the tiny model)."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.lora import LoRARequest
from pagedllm.lora.synthetic import write_random_adapter

PROMPT = [1, 504, 3458, 282, 4649, 314, 339, 2050]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def many(model_dir, tmp_path_factory):
    """500 adapters, rank 8 on q and v of two layers (bf16 files of 60 KB): 3 pages each."""
    from pagedllm.loader import load_config
    from pagedllm.models import ModelConfig

    import torch

    mc = ModelConfig.from_hf(load_config(model_dir))
    root = tmp_path_factory.mktemp("many-loras")
    return [LoRARequest(f"t{i}", i + 1, str(write_random_adapter(root / f"t{i}", mc, i, 8, ["q_proj", "v_proj"],
                                                                  layers=[3, 17], std=0.25, dtype=torch.bfloat16)))
            for i in range(500)]


def test_64_requests_over_64_of_500_adapters_in_a_pool_of_few(make_llm, many):
    llm = make_llm(dtype="float32", kv_cache_memory="24MiB", enable_lora=True, max_loras=8, max_lora_rank=8,
                   max_cpu_loras=16)
    eng = llm.engine
    chosen = many[::7][:64]
    assert eng.runner.adapters.slabs.pages(eng.runner.loras.load_now(chosen[0])) == 3
    assert eng.kv.pool.num_blocks == 34 < 3 * len(chosen)   # the pool holds the pages of at most 11 of them
    first = llm.generate([PROMPT] * 64, GREEDY, use_tqdm=False, lora_request=chosen)
    tokens = [o.outputs[0].token_ids for o in first]
    assert len(set(map(tuple, tokens))) > 16, "the adapters must matter"
    evicted = eng.kv.adapters.num_evictions
    assert evicted > 0
    # the same 64 again, the other way round: each is paged in again where it was evicted
    again = llm.generate([PROMPT] * 64, GREEDY, use_tqdm=False, lora_request=chosen[::-1])
    assert [o.outputs[0].token_ids for o in again] == tokens[::-1]
    assert eng.kv.adapters.num_evictions > evicted and eng.kv.adapters.num_loads > 64
    for i in (0, 31, 63):   # and alone
        alone = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=chosen[i])[0].outputs[0].token_ids
        assert alone == tokens[i]
    eng.kv.check_integrity()
    assert eng.kv.stats().used_blocks == 0 and not eng.kv.adapters.users and not eng.runner.loras.refs
    assert len(eng.runner.loras.entries) <= 16


def test_tp2_runs_adapters_sliced_as_their_layers(tiny_model, tmp_path):
    """LoRA under tensor parallelism: each rank pages its slice of every adapter (B's rows of its
    heads for q/k/v and gate/up, A's columns for o/down; o/down's partial deltas join the
    all-reduce), and TP=2 gives TP=1's greedy tokens for a batch mixing two adapters and the base,
    also once an adapter was evicted and paged in again (a pool of 16 blocks)."""
    from lora_adapters import make_adapter

    from pagedllm import LLM

    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    loras = [LoRARequest(f"t{i}", i + 1, str(make_adapter(tiny_model, tmp_path / f"t{i}", i, 8, 16, targets, False)))
             for i, targets in enumerate([all7, ["k_proj", "o_proj", "down_proj"]])]
    prompts = [[5, 17, 300, 4000, 12], list(range(100, 140)), [7, 8, 9, 10]]
    outs = []
    for tp in (1, 2):
        llm = LLM(model=tiny_model, tensor_parallel_size=tp, dtype="float32", num_gpu_blocks_override=16,
                  max_model_len=256, num_threads=1, enable_lora=True, max_loras=2, max_lora_rank=8)
        try:
            first = llm.generate(prompts + prompts[:1], GREEDY, use_tqdm=False,
                                 lora_request=[loras[0], None, loras[1], None])
            burst = llm.generate([list(range(3000 + 50 * i, 3040 + 50 * i)) for i in range(4)], GREEDY,
                                 use_tqdm=False)   # the idle adapters' pages go to KV
            again = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=loras[0])
            assert llm.engine.kv.adapters.num_evictions > 0
            outs.append([o.outputs[0].token_ids for o in first + burst + again])
        finally:
            llm.close()
    assert outs[0] == outs[1]
    assert outs[0][0] != outs[0][3] and outs[0][0] == outs[0][-1]   # the adapter matters; paged in again, the same
