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
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
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
    assert llm.engine.kv.stats().used_blocks == 0 and not llm.engine.runner.loras.refs


def test_an_adapter_of_another_model_is_refused_by_shape(lora_llm, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "other-model"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                         "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    save_file({key + "A.weight": torch.zeros(4, 1024), key + "B.weight": torch.zeros(576, 4)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 0 q_proj has A \(4, 1024\).*needs A \(4, 576\)"):
        lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("o", 13, str(bad)))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 576)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="targets a module we do not adapt"):
        lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("o", 14, str(bad)))


def test_held_adapters_are_dropped_least_recently_used(make_llm, adapters):
    llm = make_llm(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    reg = llm.engine.runner.loras
    first = [llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
             for a in adapters[:3]]
    assert list(reg.adapters) == [2, 3] and not reg.refs   # the first was dropped for the third
    again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters[0])[0].outputs[0].token_ids
    assert again == first[0] and list(reg.adapters) == [3, 1]   # reloaded, in place of the least recent
    eng = llm.engine
    eng.add_request("held-1", PROMPTS[0], GREEDY, lora_request=adapters[0])
    eng.add_request("held-2", PROMPTS[0], GREEDY, lora_request=adapters[1])
    with pytest.raises(ValueError, match="all 2 adapters held .* are in use"):
        eng.add_request("held-3", PROMPTS[0], GREEDY, lora_request=adapters[2])
    while eng.has_unfinished_requests():
        eng.step()
    assert not reg.refs
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters[2])[0].outputs[0].token_ids == first[2]
