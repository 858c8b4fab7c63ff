"""Beam search inside the engine against HF `generate(num_beams=k)` in float32: the same
beams (token ids) and the same length-normalised scores, for several widths, length
penalties and early-stopping rules, prompts that end on EOS and prompts that do not,
several prompts in one call, and a pool small enough that beam groups are preempted and
recomputed. Then what the KV manager did (forks, copy-on-write, blocks freed) and the
errors bad settings get."""
from __future__ import annotations

import pytest
import torch

import hf_memo

from pagedllm import LLM, BeamSearchParams, SamplingParams

PLAIN = ["The capital of France is", "1, 2, 3,", "Once upon a time in a small village by the sea, there lived"]
CHAT = [[{"role": "user", "content": "What is 2 + 2? Answer with one number only."}],
        [{"role": "user", "content": "Say hello."}]]


def hf_beams(hf_model, ids: list[int], k: int, max_tokens: int, eos: list[int], length_penalty=1.0,
             early_stopping=False):
    out = hf_memo.generate(hf_model, torch.tensor([ids]), num_beams=k, num_return_sequences=k, do_sample=False,
                            max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                            eos_token_id=eos, pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        gen = seq[len(ids):]
        # HF pads a beam that ended early: keep it up to and including its EOS.
        cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        beams.append((gen[:cut], score))
    return beams


def check_against_hf(llm: LLM, hf_model, prompts: list[list[int]], params: BeamSearchParams) -> list:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    eos = sorted(llm.engine.eos_token_ids)
    for ids, out in zip(prompts, outs):
        want = hf_beams(hf_model, ids, params.beam_width, params.max_tokens, eos, params.length_penalty,
                        params.early_stopping)
        got = [(s.tokens[len(ids):], s.score) for s in out.sequences]
        assert [g for g, _ in got] == [w for w, _ in want], f"prompt {ids[:8]}...: beams differ"
        # A score is a sum of fp32 logprobs scaled by len ** -length_penalty, so its rounding error
        # grows with its size (and differs between Intel's and AMD's fp32 kernels): compare relatively.
        for (_, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-4)
    return outs


@pytest.fixture(scope="module")
def chat_ids(llm_fp32):
    tok = llm_fp32.tokenizer
    return [tok.encode(llm_fp32.apply_chat_template(m), add_special_tokens=False) for m in CHAT]


@pytest.mark.parametrize("k", [2, 6])  # the narrowest and a wide one; width 3 below, 4 in the preemption test
def test_same_beams_as_hf(llm_fp32, hf_model, chat_ids, k):
    """Several prompts in one call: plain text that runs to max_tokens, chats that end on EOS."""
    tok = llm_fp32.tokenizer
    prompts = [tok.encode(p) for p in PLAIN[:2]] + chat_ids
    outs = check_against_hf(llm_fp32, hf_model, prompts, BeamSearchParams(beam_width=k, max_tokens=14))
    eos = llm_fp32.engine.eos_token_ids
    assert any(s.tokens[-1] in eos and s.finish_reason == "stop" for o in outs[2:] for s in o.sequences), \
        "the chat prompts should end beams on EOS"
    assert all(len(o.sequences) == k for o in outs)
    llm_fp32.engine.kv.check_integrity()
    assert llm_fp32.get_stats().kv.used_blocks == 0, "every beam's blocks go back"


@pytest.mark.parametrize("length_penalty, early_stopping", [(0.5, True), (2.0, "never"), (-1.0, False)])
def test_length_penalty_and_early_stopping_as_hf(llm_fp32, hf_model, chat_ids, length_penalty, early_stopping):
    check_against_hf(llm_fp32, hf_model, chat_ids[:1] + [llm_fp32.tokenizer.encode(PLAIN[2])],
                     BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=length_penalty,
                                      early_stopping=early_stopping))


def test_beams_fork_share_and_copy_on_write(llm_fp32):
    """A beam chosen twice forks (its blocks shared by ref count) and the shared partial
    last block is copied before either writes it; pruned beams free theirs at once."""
    before = llm_fp32.get_stats().kv
    llm_fp32.engine.step_log = []
    llm_fp32.beam_search(PLAIN[2], BeamSearchParams(beam_width=4, max_tokens=24))
    log, llm_fp32.engine.step_log = llm_fp32.engine.step_log, None
    after = llm_fp32.get_stats().kv
    assert after.forks - before.forks >= 3 and after.cow_copies - before.cow_copies >= 3
    # Four beams of ~40 tokens share their prompt's blocks: fewer blocks than four copies.
    assert any(s["used_blocks"] < s["blocks_without_sharing"] for s in log)
    assert max(s["running_seqs"] for s in log) == 4


def test_preempted_beam_groups_give_the_same_beams(make_llm, hf_model):
    """A pool of 12 blocks of 16 cannot hold three 4-beam groups: groups are preempted whole
    and recomputed, and the beams are still HF's."""
    llm = make_llm(dtype="float32", num_gpu_blocks_override=12, max_model_len=64, max_num_batched_tokens=64)
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in PLAIN]
    check_against_hf(llm, hf_model, prompts, BeamSearchParams(beam_width=4, max_tokens=16))
    assert llm.get_stats().preemptions > 0, "the small pool should force preemption"
    assert llm.get_stats().kv.used_blocks == 0
    llm.engine.kv.check_integrity()


def test_beam_search_beside_sampling(llm_fp32):
    """Beam groups and ordinary requests share steps: the ordinary ones give what they give alone."""
    engine = llm_fp32.engine
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm_fp32.generate(PLAIN[0], p, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("beams", PLAIN[1], BeamSearchParams(beam_width=4, max_tokens=10))
    engine.add_request("greedy", PLAIN[0], p)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["greedy"].outputs[0].token_ids == alone
    assert len(outs["beams"].outputs) == 4 and outs["beams"].finished


@pytest.mark.parametrize("kw, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature must be 0"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping must be"),
])
def test_bad_beam_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kw)


def test_beam_width_above_max_num_seqs_and_reserve_max_are_refused(make_llm, tiny_model):
    # The tiny model's engines: refusals need no real model (nor a reserve-max load of it).
    llm = make_llm(model=tiny_model, dtype="float32", kv_cache_memory="32MiB", max_model_len=128, max_num_seqs=4)
    with pytest.raises(ValueError, match="exceeds max_num_seqs"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=5, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="best_of must be an integer >= n"):
        SamplingParams(n=3, best_of=2)
    reserve = make_llm(model=tiny_model, dtype="float32", kv_cache_memory="32MiB", max_model_len=128,
                       allocation="reserve-max")
    with pytest.raises(ValueError, match="needs allocation 'paged'"):
        reserve.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=4))
