"""SamplingParams.prompt_logprobs (vLLM's): each prompt token's logprob given the tokens
before it, computed in the prefill, against HF transformers' full forward."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling_params import SamplingParams

TEXT = ("The library lends loose-leaf pages to readers. Readers of the same book share pages, and a page is "
        "copied only before someone writes on it. ") * 4


@pytest.fixture(scope="module")
def chunky():
    """Prompts prefilled 48 tokens a step, in a pool small enough to preempt."""
    from pagedllm import LLM

    return LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=48, num_gpu_blocks_override=40,
               block_size=8)


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_hf_across_prefill_chunks(chunky, hf_model):
    out = chunky.generate([TEXT], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    ids, plp = out.prompt_token_ids, out.prompt_logprobs
    assert len(ids) > 100 and len(plp) == len(ids) and plp[0] is None
    ref = _hf_logprobs(hf_model, ids)
    same_top = 0
    for i in range(1, len(ids)):
        entry = plp[i]
        assert next(iter(entry)) == ids[i]                       # the prompt token first
        assert entry[ids[i]].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=2e-3)
        assert abs(entry[ids[i]].rank - (int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1)) <= 1  # near-ties
        assert len(entry) in (3, 4)                               # the top 3, and the prompt token if not among them
        same_top += {t for t, lp in entry.items() if lp.rank <= 3} == set(torch.topk(ref[i - 1], 3).indices.tolist())
    assert same_top >= 0.95 * (len(ids) - 1)
    ppl = math.exp(-sum(plp[i][ids[i]].logprob for i in range(1, len(ids))) / (len(ids) - 1))
    assert 1.0 < ppl < 20, ppl   # the repeated text is easy for the model


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_preemption(chunky, hf_model):
    """A cached prefix would skip the rows that score it: such a prompt computes them all.
    Beside longer requests in a tight pool, a preempted prompt scores no token twice."""
    chunky.generate([TEXT], SamplingParams(max_tokens=1), use_tqdm=False)   # TEXT's blocks now cached
    params = [SamplingParams(max_tokens=60, ignore_eos=True)] * 3 + [SamplingParams(max_tokens=40, prompt_logprobs=0)]
    outs = chunky.generate([TEXT + " One.", TEXT + " Two.", TEXT + " Three.", TEXT], params, use_tqdm=False)
    assert chunky.engine.stats().preemptions > 0
    out = outs[3]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    ref = _hf_logprobs(hf_model, out.prompt_token_ids)
    ids = out.prompt_token_ids
    assert max(abs(out.prompt_logprobs[i][ids[i]].logprob - float(ref[i - 1, ids[i]])) for i in range(1, len(ids))) < 2e-3
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])   # k = 0: the prompt token alone
    assert chunky.engine.kv.pool.num_used == 0


def test_bad_prompt_logprobs_are_refused():
    for bad in (-1, 21, 2.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer in \\[0, 20\\]"):
            SamplingParams(prompt_logprobs=bad)
