"""LoRA adapters beside the base model (enable_lora): PEFT adapters made here on the SmolLM2
base, random in both A and B so that each changes the output. In fp32 one batch mixing four
adapters and the base gives, for every prompt, the greedy tokens of PEFT's own unmerged
PeftModel on that adapter. The prefix cache never shares blocks across adapters; bad adapters
and requests are refused naming the problem, with nothing left queued."""
from __future__ import annotations

import json

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.lora import LoRARequest

import hf_memo
from lora_adapters import make_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, targets, rsLoRA) of each adapter: ranks and targets differ within one batch
ADAPTERS = [(8, 16, ALL, False), (16, 8, ["q_proj", "v_proj"], False), (4, 8, ["gate_proj", "up_proj", "down_proj"], True),
            (8, 32, ["k_proj", "o_proj", "up_proj"], False)]
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 2162, 253, 655, 28, 253], [1, 378, 1838, 3549, 282, 260],
           [1, 8302, 436, 1041, 30], [1, 504, 3458, 282, 4649, 314, 339, 2050]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return [LoRARequest(f"a{i}", i + 1, str(make_adapter(model_dir, root / f"a{i}", i, *spec)))
            for i, spec in enumerate(ADAPTERS)]


@pytest.fixture(scope="module")
def lora_llm(make_llm):
    return make_llm(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=4, max_lora_rank=16)


def peft_greedy(model_dir, req: LoRARequest | None, ids: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if req is not None:
        model = PeftModel.from_pretrained(model, req.lora_path)  # unmerged: base + scaling * B A x
    out = hf_memo.generate(model, torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_a_mixed_batch_gives_each_adapters_peft_tokens(lora_llm, adapters, model_dir):
    loras = [None, *adapters]   # prompt 0 on the base model, prompts 1-4 on adapters 1-4, all one batch
    outs = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outs]
    want = [peft_greedy(model_dir, req, ids) for req, ids in zip(loras, PROMPTS)]
    assert got == want
    # the adapters matter: under each, the prompts give other tokens than the base's
    runs = [[o.outputs[0].token_ids for o in lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=r)]
            for r in loras]
    assert all(run != runs[0] for run in runs[1:])


def test_prefix_cache_is_per_adapter(lora_llm, adapters):
    prompt = list(range(100, 180))   # five full blocks
    first = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    again = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    other = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[1])[0]
    base = lora_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 64 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_bad_adapters_and_requests_are_refused(lora_llm, adapters, tmp_path, make_llm):
    llm = lora_llm
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None, LoRARequest("x", 9, str(tmp_path))])
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.stats().used_blocks == 0  # nothing left queued
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 64, "lora_alpha": 8}))
    with pytest.raises(ValueError, match="rank 64, above max_lora_rank 16"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 10, str(big)))
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="uses DoRA, which is not supported"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 11, str(dora)))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((lambda p: p.read_text())(
        __import__("pathlib").Path(adapters[0].lora_path) / "adapter_config.json"))
    (broken / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("broken", 12, str(broken)))
    with pytest.raises(ValueError, match="needs an id of its own"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, adapters[1].lora_path))
    with pytest.raises(ValueError, match="lora_int_id must be an int > 0"):
        LoRARequest("zero", 0, adapters[0].lora_path)
    plain = make_llm(dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="start it with enable_lora=True"):
        plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters[0])
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters[0])[0].outputs[0].token_ids
    assert llm.engine.kv.stats().used_blocks == 0 and not llm.engine.runner.loras.refs and not llm.engine.kv.adapters.users


def test_an_adapter_of_another_model_is_refused_by_shape(lora_llm, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "other-model"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                         "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    save_file({key + "A.weight": torch.zeros(4, 1024), key + "B.weight": torch.zeros(576, 4)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 0 self_attn.q_proj has A \(4, 1024\).*needs A \(4, 576\)"):
        lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("o", 13, str(bad)))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 576)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="targets a module we do not adapt"):
        lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("o", 14, str(bad)))


def test_adapter_pages_follow_the_stated_formula(lora_llm, adapters):
    """lora.layout's formula, worked by hand for SmolLM2 in fp32: a block's slab (one layer's K
    or V row of 16 tokens x 3 heads x 64) is 3072 elements, cut in cells of W = 192, 32 cells a
    page a layer. A rank-r adapter on every matmul takes a layer r x (q 3+3, k 3+1, v 3+1, o 3+3,
    gate 3+8, up 3+8, down 8+3) = 53 r cells, so ceil(53 r / 32) pages."""
    eng = lora_llm.engine
    geo = eng.runner.adapters.slabs.geometry
    assert (geo.slab, geo.width, geo.cells_per_page) == (3072, 192, 32)
    lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters[0])   # rank 8, every matmul
    figures = eng.kv.stats().adapters
    pages = eng.kv.adapters.pages[1]
    assert len(pages) == -(-53 * 8 // 32) == 14 == eng.runner.loras.load_now(adapters[0]).num_pages
    assert figures.held_pages == 0 and figures.idle_pages >= 14   # resident, unused: its pages are free to take
    assert eng.stats().kv.as_dict()["adapters"]["idle_pages"] == figures.idle_pages
    from pagedllm.engine.kv_report import kv_report
    assert f"LoRA adapters in the pool: {figures.resident} resident" in kv_report(eng.stats())
    # a constrained request under an adapter: the grammar holds whatever the adapter prefers
    from pagedllm import StructuredOutputsParams
    regex = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,6}"))
    text = lora_llm.generate(PROMPTS[:1], regex, use_tqdm=False, lora_request=adapters[0])[0].outputs[0].text
    assert text.isalpha() and text.islower() and 3 <= len(text) <= 6, text
    # in bytes: 14 pool blocks of 2 x 30 layers x 16 tokens x 192 x 4 bytes
    assert len(pages) * eng.runner.bytes_per_block == 14 * 737_280


def test_adapters_wait_for_room_and_are_evicted_and_paged_in_again(make_llm, adapters):
    """A pool of 22 blocks cannot hold the four adapters (14, 5, 5 and 6 pages) at once, and
    max_loras = 2 runs two at a time: every request still completes with its own tokens (as
    alone), adapters are evicted and paged in again, and nothing leaks."""
    llm = make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    eng = llm.engine
    assert eng.kv.pool.num_blocks == 22
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [llm.generate(PROMPTS[:1], short, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
             for a in adapters]
    assert eng.kv.adapters.num_evictions >= 1   # the fourth found the first's pages taken
    seen: list[int] = []
    prompts, loras = PROMPTS[:1] * 8, adapters * 2
    ids = [eng.add_request(None, p, short, lora_request=a).request_id for p, a in zip(prompts, loras)]
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        seen.append(len(eng.kv.adapters.users))
        eng.kv.check_integrity()
    assert max(seen) == 2   # never more than max_loras at once
    assert [outs[i] for i in ids] == alone * 2
    assert eng.kv.stats().used_blocks == 0 and not eng.kv.adapters.users and not eng.runner.loras.refs
    assert eng.kv.adapters.num_loads > 4   # paged in again after eviction


def test_a_failed_adapter_read_ends_its_request_alone(make_llm, adapters, tmp_path):
    """Read on the loader's thread, an adapter that turns out unreadable ends its request with the
    error; the others of the step complete."""
    llm = make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    eng = llm.engine
    bad = tmp_path / "gone"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    eng.add_request("bad", PROMPTS[0], GREEDY, lora_request=LoRARequest("gone", 40, str(bad)))
    eng.add_request("good", PROMPTS[0], GREEDY, lora_request=adapters[1])
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
    assert outs["bad"].outputs[0].finish_reason == "error" and "no adapter_model.safetensors" in outs["bad"].error
    assert len(outs["good"].outputs[0].token_ids) == 12
    assert eng.kv.stats().used_blocks == 0 and not eng.runner.loras.refs and 40 not in eng.runner.loras.entries


def test_adapters_run_over_weight_only_quantized_bases_and_w8a8_is_refused(make_llm, adapters):
    """QLoRA's case: the base on q8_0 blocks, the adapter's pass in float beside it. Under the
    adapter the int8 base gives the fp32 base's adapted tokens (q8_0 is close to exact), not the
    base's own; SmoothQuant (w8a8) rescales the matmuls' inputs and is refused by name."""
    llm = make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16,
                   quantization="int8")
    prompt = PROMPTS[4]
    got = llm.generate([prompt] * 2, GREEDY, use_tqdm=False, lora_request=[adapters[0], None])
    exact = make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    want = exact.generate([prompt] * 2, GREEDY, use_tqdm=False, lora_request=[adapters[0], None])
    agree = [sum(a == b for a, b in zip(g.outputs[0].token_ids, w.outputs[0].token_ids)) for g, w in zip(got, want)]
    assert agree[0] >= 8 and got[0].outputs[0].token_ids != got[1].outputs[0].token_ids, agree
    with pytest.raises(ValueError, match="w8a8 is not supported: SmoothQuant"):
        make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, quantization="w8a8")


def test_a_draft_model_proposes_on_the_base_and_the_adapter_verifies(make_llm, adapters, model_dir):
    """Speculation under an adapter: the draft model (the base) proposes, the target verifies
    under the request's adapter, and greedy tokens are those of no speculation."""
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    llm = make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16,
                   speculative_config=spec)
    plain = make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    loras = [adapters[1], None, adapters[2]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False, lora_request=loras)
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.stats().spec.num_accepted_tokens > 0
