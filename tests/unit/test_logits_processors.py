"""Penalties, logit_bias, min_tokens and min_p against HF's logits processors (or a case
computed by hand), batched with rows that must stay untouched, then through the engine."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from pagedllm import SamplingParams
from pagedllm.plan import SampleTarget
from pagedllm.runtime.logits_processors import process_logits
from pagedllm.runtime.sampler import sample

V = 50
PROMPT = [3, 7, 7, 11]
OUTPUT = [7, 20, 20, 20, 42]


def seq(seq_id: int = 0, prompt=PROMPT, output=OUTPUT, **kw) -> SampleTarget:
    return SampleTarget(seq_id, SamplingParams(max_tokens=64, **kw), seq_id, list(prompt) + list(output), len(prompt))


def processed(s: SampleTarget, logits: torch.Tensor, eos_ids=()) -> torch.Tensor:
    """Row 1 of a batch whose rows 0 and 2 ask for nothing (and must come back as they were)."""
    batch = torch.stack([logits + 1, logits, logits - 1])
    out = process_logits(batch, [[seq(10)], [s], [seq(11)]], eos_ids)
    torch.testing.assert_close(out[0], batch[0], rtol=0, atol=0)
    torch.testing.assert_close(out[2], batch[2], rtol=0, atol=0)
    return out[1]


@pytest.fixture
def logits():
    return torch.randn(V, generator=torch.Generator().manual_seed(0)) * 3


def test_rows_that_ask_for_nothing_cost_nothing(logits):
    batch = logits.repeat(2, 1)
    assert process_logits(batch, [[seq(0)], [seq(1, temperature=0.0)]]) is batch


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(logits, penalty):
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]), logits[None].clone())[0]
    torch.testing.assert_close(processed(seq(repetition_penalty=penalty), logits), want)


def test_frequency_and_presence_penalties_by_hand(logits):
    """OpenAI's formula on the output only: token 20 appears 3 times, 7 and 42 once, the
    prompt's 3 and 11 never in the output."""
    got = processed(seq(frequency_penalty=0.5, presence_penalty=-1.25), logits)
    want = logits.clone()
    for t, n in {7: 1, 20: 3, 42: 1}.items():
        want[t] -= 0.5 * n - 1.25
    torch.testing.assert_close(got, want)


def test_logit_bias_matches_hf_sequence_bias(logits):
    bias = {5: 12.5, 20: -100.0, 49: 0.25}
    hf = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])
    want = hf(torch.tensor([PROMPT + OUTPUT]), logits[None].clone())[0]
    torch.testing.assert_close(processed(seq(logit_bias=bias), logits), want)


@pytest.mark.parametrize("min_tokens, masked", [(8, True), (5, False)])
def test_min_tokens_matches_hf(logits, min_tokens, masked):
    eos = [2, 9]
    hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), min_tokens, eos + [13])
    want = hf(torch.tensor([PROMPT + OUTPUT]), logits[None].clone())[0]
    got = processed(seq(min_tokens=min_tokens, stop_token_ids=[13]), logits, eos_ids=eos)
    torch.testing.assert_close(got, want)
    assert math.isinf(got[13]) == masked
    # ignore_eos: EOS cannot end the output anyway, and stays pickable (vLLM's rule).
    got = processed(seq(min_tokens=min_tokens, stop_token_ids=[13], ignore_eos=True), logits, eos_ids=eos)
    assert not got[eos].isinf().any() and math.isinf(got[13]) == masked


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.6), (1.0, 1.0)])
def test_min_p_matches_hf_after_temperature(min_p, temperature):
    """HF applies the temperature first, then MinP; we keep the row undivided (the sampler
    divides), so compare what survives and that survivors are unchanged. Logits spread
    evenly: the temperature moves the cut by several tokens."""
    logits = torch.linspace(0, -8, V)[torch.randperm(V, generator=torch.Generator().manual_seed(1))]
    scaled = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    want_kept = ~MinPLogitsWarper(min_p)(None, scaled)[0].isinf()
    got = processed(seq(min_p=min_p, temperature=temperature), logits)
    assert torch.equal(~got.isinf(), want_kept) and 0 < want_kept.sum() < V
    torch.testing.assert_close(got[want_kept], logits[want_kept])


def test_greedy_rows_obey_penalties_and_bias(logits):
    """Greedy takes the max of the processed row: a big bias wins, a banned token loses."""
    top = int(logits.argmax())
    out, _, _ = sample(logits.repeat(2, 1), [[seq(0, temperature=0.0, logit_bias={top: -100.0})],
                                             [seq(1, temperature=0.0, logit_bias={17: 100.0})]])
    assert out[0] == int(logits.topk(2).indices[1]) and out[1] == 17


def test_sampled_rows_draw_from_the_processed_distribution():
    """min_p and a penalty together, sampled: only tokens that survive can come out."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    rows = [[seq(i, prompt=[0], output=[], temperature=1.0, min_p=0.5, repetition_penalty=100.0)] for i in range(300)]
    out, _, _ = sample(logits.repeat(300, 1), rows)
    # Token 0 is in the prompt (logit -0.92 x 100), min_p keeps p >= 0.5 x p(1): tokens 1 and 2.
    assert set(out.values()) == {1, 2}


def test_a_bad_logit_bias_fails_its_request_alone(logits):
    out, _, errors = sample(logits.repeat(2, 1), [[seq(0, logit_bias={V + 5: 1.0})], [seq(1, temperature=0.0)]])
    assert 0 in errors and "logit_bias" in errors[0] and out == {1: int(logits.argmax())}


@pytest.mark.parametrize("kw, field", [
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(logit_bias={1: math.inf}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
])
def test_invalid_settings_name_their_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
