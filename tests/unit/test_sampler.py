"""The sampler, both ways (the compiled CPU kernel and plain torch): the distribution it
draws from, seeds, robustness to tiny logit changes, and hostile settings."""
from __future__ import annotations

import collections

import pytest
import torch

from pagedllm.kernels import load_ops
from pagedllm.plan import SampleTarget
from pagedllm.runtime.sampler import sample, weights
from pagedllm.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])


@pytest.fixture(params=["kernel", "torch"])
def kernels(request):
    return load_ops() if request.param == "kernel" else None


def seqs(n: int, first_id: int = 0, **kw) -> list[SampleTarget]:
    p = SamplingParams(**kw)
    return [SampleTarget(i, p, i, [1], 1) for i in range(first_id, first_id + n)]


def frequencies(kernels, n: int = 6000, **kw) -> torch.Tensor:
    logits = torch.log(PROBS + 1e-30).repeat(n, 1)
    out, _, _ = sample(logits, [[s] for s in seqs(n, **kw)], kernels)
    counts = collections.Counter(out.values())
    return torch.tensor([counts.get(i, 0) / n for i in range(len(PROBS))])


@pytest.mark.parametrize("kw, want", [
    (dict(temperature=1.0), PROBS),
    (dict(temperature=1.0, top_k=2), torch.tensor([5 / 7, 2 / 7, 0, 0, 0, 0, 0, 0])),
    # top_p 0.75: 0.5 + 0.2 < 0.75, so one of the 0.1 tokens joins (the first of the tie).
    (dict(temperature=1.0, top_p=0.75), torch.tensor([0.625, 0.25, 0.125, 0, 0, 0, 0, 0])),
    (dict(temperature=0.5), PROBS ** 2 / (PROBS ** 2).sum()),
])
def test_draws_follow_the_distribution(kernels, kw, want):
    torch.testing.assert_close(frequencies(kernels, **kw), want, atol=0.025, rtol=0)


@pytest.mark.parametrize("kw", [dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-50),
                                dict(temperature=5e-324), dict(temperature=1.0, top_p=5e-324, top_k=1)])
def test_extreme_settings_pick_the_top_token(kernels, kw):
    """Tiny temperatures and top_p below float32's range: the top token, no NaN, no crash."""
    assert frequencies(kernels, 200, **kw)[0] == 1.0


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=1.0, top_p=1e-6), dict(temperature=1.0, top_k=3),
                                dict(temperature=0.7, top_k=3, top_p=0.5)])
def test_infinite_and_nan_logits_do_not_crash(kernels, kw):
    """A repetition penalty near 0 divides logits by it (+inf); a processor may leave NaN.
    The +inf tokens share the top; a row with nothing finite still gives a token id."""
    pos = torch.tensor([0.5, float("inf"), -1.0, float("nan"), float("inf"), 0.0, -float("inf"), 2.0]).repeat(50, 1)
    out, _, _ = sample(pos, [[s] for s in seqs(50, **kw)], kernels)
    assert set(out.values()) <= {1, 4}
    dead = torch.tensor([float("nan")] * 4 + [-float("inf")] * 4)[None]
    out, _, _ = sample(dead, [seqs(1, **kw)], kernels)
    assert all(0 <= t < 8 for t in out.values())


def test_repetition_penalty_at_its_floor_samples_a_token():
    """The fuzzer's request that crashed the kernel: best_of, top_p and repetition_penalty at
    the smallest doubles, through the logits processors."""
    logits = torch.randn(5, 64)
    out, _, errors = sample(logits, [[s] for s in seqs(5, temperature=1.0, top_p=5e-324, repetition_penalty=5e-324)],
                            load_ops())
    assert not errors and all(0 <= t < 64 for t in out.values())


def test_same_seed_same_tokens_whatever_the_batch(kernels):
    logits = torch.randn(1, 1000)
    alone, _, _ = sample(logits, [seqs(1, first_id=7, temperature=0.9, top_p=0.9)], kernels)
    mixed_logits = torch.cat([torch.randn(3, 1000), logits])
    batch = seqs(3, first_id=0, temperature=1.0, top_k=5) + seqs(1, first_id=7, temperature=0.9, top_p=0.9)
    together, _, _ = sample(mixed_logits, [[s] for s in batch], kernels)
    assert together[7] == alone[7]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.95), dict(temperature=1.3, top_k=40)])
def test_tiny_logit_changes_rarely_change_the_draw(kernels, kw):
    """A cached prefix or another batch changes logits by ~1e-6: the same seed must still
    give the same token almost always (a cumulative-sum draw flipped a few % of them)."""
    g = torch.Generator().manual_seed(0)
    n = 400
    logits = 3 * torch.randn(n, 49152, generator=g)
    nudged = logits * (1 + 1e-6 * torch.randn(n, 49152, generator=g))
    a, _, _ = sample(logits, [[s] for s in seqs(n, **kw)], kernels)
    b, _, _ = sample(nudged, [[s] for s in seqs(n, **kw)], kernels)
    assert sum(a[i] != b[i] for i in a) <= 2


def test_greedy_and_sampled_rows_mix_with_logprobs(kernels):
    logits = torch.log(PROBS + 1e-30).repeat(3, 1)
    g, r = seqs(1, temperature=0.0, logprobs=2)[0], seqs(1, first_id=1, temperature=1.0, logprobs=0)[0]
    out, lps, _ = sample(logits, [[g], [r], []], kernels)
    assert out[0] == 0 and list(lps[0]) == [0, 1] and [lp.rank for lp in lps[0].values()] == [1, 2]
    assert list(lps[1]) == [out[1]] and lps[1][out[1]].rank == 1 + int((PROBS > PROBS[out[1]]).sum())
    assert abs(lps[0][0].logprob - float(torch.log(PROBS[0]))) < 1e-4


@pytest.mark.parametrize("temperature, kw", [
    (1.0, dict(top_p=0.3)), (1.0, dict(top_k=12)), (1.0, dict(top_k=30, top_p=0.5)), (1.0, dict(top_p=0.9)),
    # A client's high temperature squeezes every score near 0; past 1e20 the kernel's is 1e20.
    (100.0, dict(top_p=0.01)), (1e6, dict(top_p=0.005)), (1e6, dict(top_k=12)), (1e38, dict(top_k=20, top_p=0.5))])
def test_a_large_vocabularys_bounds_are_the_references(temperature, kw):
    """The kernel searches only the score bucket where a top-k or top-p bound falls (a row's
    buckets span its own scores): the tokens it draws are the reference's allowed set (weights),
    every one of them, and none past it. 40 leading tokens above 4k flat ones; top_p 0.9 ends
    inside the flat crowd, whose buckets hold hundreds."""
    g = torch.Generator().manual_seed(1)
    row = 0.3 * torch.randn(4096, generator=g)
    row[:40] = 5 - 0.02 * torch.arange(40)
    row = row[torch.randperm(4096, generator=g)]
    allowed = set(torch.nonzero(weights(row, SamplingParams(temperature=temperature, **kw))).flatten().tolist())
    n = 3000
    out, _, _ = sample(row.repeat(n, 1), [[s] for s in seqs(n, temperature=temperature, **kw)], load_ops())
    drawn = set(out.values())
    assert drawn == allowed if len(allowed) <= 64 else drawn <= allowed and len(drawn) > 1000, (len(drawn), len(allowed))


@pytest.mark.parametrize("temperature, kw", [(1.0, dict(top_p=0.02)), (1e6, dict(top_p=0.01)),
                                             (1.0, dict(top_k=45)), (1.0, dict(top_k=2000, top_p=0.04))])
def test_a_bound_inside_a_crowded_bucket_is_exact(temperature, kw):
    """4,000 tokens within ~1e-3 of each other under 30 spread ones: the crowd shares one bucket, and
    the bound falls inside it, so the kernel selects among 4,000 (never sorting them): it draws
    exactly the reference's set, the 30 and the crowd's best few."""
    g = torch.Generator().manual_seed(2)
    row = 4.0 + 1e-4 * torch.randn(4030, generator=g)
    row[:30] = 5 - 0.02 * torch.arange(30)
    row = row[torch.randperm(4030, generator=g)]
    allowed = set(torch.nonzero(weights(row, SamplingParams(temperature=temperature, **kw))).flatten().tolist())
    assert 30 < len(allowed) <= 64
    n = 3000
    out, _, _ = sample(row.repeat(n, 1), [[s] for s in seqs(n, temperature=temperature, **kw)], load_ops())
    assert set(out.values()) == allowed


@pytest.mark.parametrize("kw", [dict(top_p=0.005), dict(top_p=0.003), dict(top_k=3000, top_p=0.004)])
def test_tied_scores_go_to_the_lowest_indices(kw):
    """A row of one value (what a temperature near float's top makes of any row): best first is
    index order, so top-p keeps the lowest indices, as the reference's stable sort does. (Top-k
    keeps every token tied with its k-th, here all of them.)"""
    row = torch.zeros(4096)
    allowed = set(torch.nonzero(weights(row, SamplingParams(temperature=1.0, **kw))).flatten().tolist())
    assert allowed == set(range(len(allowed))) and 10 < len(allowed) < 40
    n = 3000
    out, _, _ = sample(row.repeat(n, 1), [[s] for s in seqs(n, temperature=1.0, **kw)], load_ops())
    assert set(out.values()) == allowed
