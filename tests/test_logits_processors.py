"""Penalties, logit_bias, min_tokens and min_p against HF's logits processors (or a case
computed by hand), batched with rows that must stay untouched, then through the engine."""
from __future__ import annotations


import pytest
import torch

from pagedllm import SamplingParams

V = 50


@pytest.fixture
def logits():
    return torch.randn(V, generator=torch.Generator().manual_seed(0)) * 3


def test_engine_min_tokens_cumulative_logprob_and_logprob_shape(llm_fp32):
    engine = llm_fp32.engine
    eos = min(engine.eos_token_ids)
    # EOS pushed to the top: it ends the output the first step min_tokens allows it.
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, logit_bias={eos: 100.0}, logprobs=3)
    c = llm_fp32.generate(["Once upon a time"], params)[0].outputs[0]
    assert len(c.token_ids) == 7 and c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
    assert c.finish_reason == "stop"
    assert len(c.logprobs) == 7 and all(len(lp) in (3, 4) for lp in c.logprobs)
    for t, lp in zip(c.token_ids, c.logprobs):
        assert next(iter(lp)) == t and lp[t].decoded_token is not None
        assert sorted(v.rank for i, v in lp.items() if i != t and v.rank <= 3) == [r for r in (1, 2, 3) if r != lp[t].rank]
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    plain = llm_fp32.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad-bias", "Hi", SamplingParams(logit_bias={engine.model_cfg.vocab_size: 1.0}))


def test_best_of_returns_the_n_most_likely_samples(llm_fp32):
    """best_of=4, n=2 draws the same four samples as n=4 with the same seed, and returns
    the two of highest cumulative logprob, best first."""
    kw = dict(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True)
    four = llm_fp32.generate(["The weather today"], SamplingParams(n=4, logprobs=0, **kw))[0].outputs
    best = llm_fp32.generate(["The weather today"], SamplingParams(n=2, best_of=4, **kw))[0].outputs
    ranked = sorted(four, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in best] == [0, 1] and [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked])
    assert best[0].logprobs is None and best[0].cumulative_logprob >= best[1].cumulative_logprob
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
