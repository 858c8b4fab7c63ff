"""Speculative decoding (n-gram prompt lookup) on the paged KV cache: the proposer, the
lookahead slots and their rollback in the KV manager, the rejection sampler's exactness,
and the engine's output with speculation against its output without."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from pagedllm.config import EngineConfig
from pagedllm.kv import KVCacheManager
from pagedllm.plan import SampleTarget
from pagedllm.runtime.ngram import NgramIndex
from pagedllm.runtime.rejection import Verify, verify
from pagedllm.sampling_params import SamplingParams


# -- the proposer ---------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    idx = NgramIndex(1, 3)
    assert idx.propose([1, 2, 3, 4, 5, 1, 2, 3], 4) == [4, 5, 1, 2]
    # The longest suffix wins: (9, 1, 2) occurred once, (1, 2) more recently elsewhere.
    assert NgramIndex(1, 3).propose([9, 1, 2, 7, 7, 1, 2, 8, 9, 1, 2], 2) == [7, 7]
    assert NgramIndex(2, 3).propose([1, 2, 3], 2) == []          # no earlier occurrence
    assert NgramIndex(1, 1).propose([5], 3) == []                 # nothing before the suffix


@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_incremental_index_equals_a_fresh_scan(tokens, n_max):
    """Built a few tokens at a time (as a decoding sequence grows) or at once: same drafts,
    and each draft really follows an occurrence of the longest matching suffix."""
    grown = NgramIndex(1, n_max)
    for L in range(1, len(tokens) + 1):
        draft = grown.propose(tokens[:L], 3)
        assert draft == NgramIndex(1, n_max).propose(tokens[:L], 3)
        if draft:
            best = max(n for n in range(1, min(n_max, L - 1) + 1)
                       if any(tokens[e - n:e] == tokens[L - n:L] for e in range(n, L)))
            end = max(e for e in range(best, L) if tokens[e - best:e] == tokens[L - best:L])
            assert draft == tokens[end:min(end + 3, L)]


# -- lookahead slots and rollback in the KV manager ---------------------------------
def test_draft_tokens_are_never_cached_and_rejected_blocks_go_back():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    kv.allocate_slots(0, prompt, 6)
    assert len(kv.pool.cached) == 1                    # block 0 is full of prompt tokens
    free_before = kv.pool.num_available
    # The sampled token 9 decodes at position 6 with 5 drafts behind it: slots for 12 tokens.
    seq = prompt + [9]
    kv.allocate_slots(0, seq, 12, lookahead=5)
    assert kv.block_table(0).num_tokens == 12 and kv.pool.num_available == free_before - 1
    assert len(kv.pool.cached) == 1, "a block holding draft tokens must not enter the prefix cache"
    # One draft accepted: KV is right for 7 + 1 = 8 tokens; block 2 held only rejected ones.
    freed = kv.rollback(0, 8, seq + [7])
    assert len(freed) == 1 and kv.pool.num_available == free_before
    assert kv.block_table(0).num_tokens == 8 and len(kv.block_table(0).block_ids) == 2
    assert len(kv.pool.cached) == 2                    # block 1 (tokens 4..7) is verified now
    kv.check_integrity()
    # The same prompt and accepted tokens hit both cached blocks.
    assert kv.lookup_prefix(seq + [7, 1]) == kv.block_table(0).block_ids[:2]
    kv.free(0)
    kv.check_integrity()
    assert kv.pool.num_used == 0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=40),
       st.sampled_from(["paged", "reserve-max"]))
@settings(max_examples=120, deadline=None)
def test_lookahead_and_rollback_keep_the_pool_consistent(ops, policy):
    """Random decodes with drafts, partial acceptance, forks sharing blocks and frees: the
    invariants hold after each, and only verified tokens ever reach the prefix cache."""
    kv = KVCacheManager(num_blocks=24, block_size=4, policy=policy, max_model_len=40)
    tokens: dict[int, list[int]] = {}
    for seq, d, a in ops:
        if seq not in tokens:  # a prompt prefilled, then the token it sampled (not yet in the cache)
            toks = [7, 1, 2, 3, 7, 1][: 2 + seq]
            if kv.allocate_slots(seq, toks, len(toks)) is None:
                continue
            tokens[seq] = toks + [seq]
            continue
        toks = tokens[seq]
        n = len(toks) + d   # the last token and d drafts after it
        if n > 40 or kv.allocate_slots(seq, toks, n, lookahead=d) is None:
            continue
        kv.check_integrity()
        a = min(a, d)
        accepted = [(len(toks) + i) * 3 % 5 for i in range(a)]
        kv.rollback(seq, len(toks) + a, toks + accepted)
        toks += accepted + [len(toks) % 5]   # the token sampled after them
        kv.check_integrity()
        if seq == 1 and 3 not in tokens and policy == "paged":
            kv.fork(1, 3)
            tokens[3] = list(toks)
        for blk in kv.pool.blocks:  # a cached block's key is that of verified tokens of some sequence
            if blk.block_hash is not None:
                assert any(blk.block_hash in kv.tables[s].hashes.update(tokens[s])[:kv.tables[s].num_tokens // 4]
                           for s in kv.tables if s in tokens) or kv.pool.is_available(blk.block_id)
    for s in list(kv.tables):
        kv.free(s)
    kv.check_integrity()
    assert kv.pool.num_used == 0


# -- the rejection sampler -------------------------------------------------------------
def _target(seq_id: int, params: SamplingParams, seed: int, tokens=(1, 2, 3)) -> SampleTarget:
    return SampleTarget(seq_id, params, seed, list(tokens), len(tokens))


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([4, 6, 9, 2]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    accepted, tokens, errors = verify(logits, [Verify(0, _target(0, greedy, 0), [4, 6, 1])], frozenset(), {})
    assert accepted == {0: [4, 6]} and tokens == {0: 9} and not errors
    accepted, tokens, _ = verify(logits, [Verify(0, _target(0, greedy, 0), [4, 6, 9])], frozenset(), {})
    assert accepted == {0: [4, 6, 9]} and tokens == {0: 2}       # all kept: the last row adds one


def test_sampled_verification_follows_the_target_distribution():
    """Drafts [3, 5] against rows p0 and p1: the first token must be distributed as p0, and
    after a 3 the second as p1, exactly (chi-square over 6000 seeded draws each)."""
    V = 6
    p0 = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.25, 0.15])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.1, 0.1, 0.4])
    logits = torch.stack([p0.log(), p1.log(), p1.log()])
    params = SamplingParams(temperature=1.0, seed=0)
    first, second = [0] * V, [0] * V
    for seed in range(6000):
        acc, tok, _ = verify(logits, [Verify(0, _target(0, params, seed), [3, 5])], frozenset(), {})
        out = acc[0] + [tok[0]]
        first[out[0]] += 1
        if out[0] == 3:
            second[out[1]] += 1
    for got, p in ((first, p0), (second, p1)):
        want = p.double() / p.double().sum() * sum(got)
        assert chisquare(got, want.tolist()).pvalue > 1e-3, (got, want)
    assert first[3] > 0.25 * 6000   # the draft is accepted as often as p0 makes it


def test_one_bad_request_fails_alone_in_verification():
    logits = torch.zeros(4, 8)
    good = Verify(0, _target(0, SamplingParams(temperature=0), 0), [1])
    bad = Verify(2, _target(1, SamplingParams(temperature=0.7, logit_bias={99: 1.0}), 0), [1])
    accepted, tokens, errors = verify(logits, [good, bad], frozenset(), {})
    assert 0 in tokens and 1 not in tokens and 1 not in accepted and "logit_bias" in errors[1]


@pytest.mark.parametrize("bad, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 64\], got"),
    ({"method": "ngram", "num_speculative_tokens": 65}, r"num_speculative_tokens must be an integer in \[1, 64\]"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of .*draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup_max": 3}, r"unknown keys \['lookup_max'\]"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min 5 >"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1"),
    ("{not json", "not valid JSON"),
    ("[4]", "must be a JSON object"),
])
def test_bad_speculative_config_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=bad)


# -- a draft model -----------------------------------------------------------------
