"""Speculative decoding (n-gram prompt lookup) on the paged KV cache: the proposer, the
lookahead slots and their rollback in the KV manager, the rejection sampler's exactness,
and the engine's output with speculation against its output without."""
from __future__ import annotations

import inspect
import random
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency, chisquare

from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.engine.speculative import SpecStats
from pagedllm.runtime.ngram import NgramIndex
from pagedllm.kv import KVCacheManager
from pagedllm.kv.block_table import BlockTable
from pagedllm.plan import SampleTarget
from pagedllm.runtime.rejection import Verify, verify
from pagedllm.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


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


# -- the engine ----------------------------------------------------------------------
# A real function of ours, as code-editing prompts carry.
CODE = textwrap.dedent(inspect.getsource(BlockTable.slots))
PROMPTS = [
    "Rewrite this function, renaming `out` to `result`:\n" + CODE,
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 40, separated by commas.",
    "What is the capital of France?",
    "Write a haiku about paging.",
    "Summarize: " + "The library lends loose-leaf pages to readers who share books. " * 6,
]


@pytest.fixture(scope="module")
def prompts():
    from pagedllm.bench.workloads import sharegpt_truncated

    return PROMPTS + [r.prompt for r in sharegpt_truncated(10, 256, 64)]


@pytest.fixture(scope="module")
def spec_llm():
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048, speculative_config=NGRAM)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_output_is_the_same_with_speculation(llm_fp32, spec_llm, prompts):
    """Token for token, on prompts that repeat text (many drafts accepted) and on ShareGPT
    prompts that mostly do not; stop strings and max_tokens cut inside accepted runs."""
    params = [SamplingParams(temperature=0, max_tokens=64),
              SamplingParams(temperature=0, max_tokens=37, stop=[", 2"]),
              SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)]
    before = spec_llm.engine.stats().spec
    for p in params:
        want = _ids(llm_fp32.generate(prompts, p, use_tqdm=False))
        got = _ids(spec_llm.generate(prompts, p, use_tqdm=False))
        assert got == want
        assert all(len(g) <= p.max_tokens for g in got)
    s = spec_llm.engine.stats().spec
    assert s.num_drafts - before.num_drafts > 50
    assert 0.1 < s.acceptance_rate < 1.0, s        # both accepted and rejected drafts were exercised
    assert spec_llm.engine.kv.pool.num_used == 0
    spec_llm.engine.kv.check_integrity()


def test_some_sequences_speculate_while_others_decode_normally(llm_fp32, spec_llm):
    """In one batch: greedy requests speculate; one that asks for logprobs and one with a
    repetition penalty (checked row by row against the drafts) stay exact too."""
    text = PROMPTS[0]
    params = [SamplingParams(temperature=0, max_tokens=48), SamplingParams(temperature=0, max_tokens=48, logprobs=2),
              SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.3)]
    want = [llm_fp32.generate([text], p, use_tqdm=False)[0] for p in params]
    got = spec_llm.generate([text] * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(got[1].outputs[0].logprobs) == 48


def test_speculation_survives_preemption_and_frees_everything():
    """A pool too small for the batch: drafts are dropped before anyone is preempted, and
    preempted sequences recompute; the output is the plain engine's, no block leaks."""
    from pagedllm import LLM

    outs = {}
    for spec in (None, NGRAM):
        llm = LLM(dtype="float32", num_gpu_blocks_override=24, block_size=8, max_model_len=512,
                  speculative_config=spec)
        outs[spec is None] = _ids(llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=40,
                                                                           ignore_eos=True), use_tqdm=False))
        assert llm.engine.stats().preemptions > 0
        assert llm.engine.kv.pool.num_used == 0
        llm.engine.kv.check_integrity()
    assert outs[True] == outs[False]


def test_seeded_sampling_keeps_the_target_distribution(llm_fp32, spec_llm):
    """Temperature 1 on a prompt whose continuation the n-gram lookup drafts: each of the
    first output tokens' frequencies over 240 seeds, with and without speculation, come
    from the same distribution (chi-square test of homogeneity per position, tokens seen
    fewer than 10 times pooled)."""
    prompt = "Repeat after me three times: the quick brown fox jumps over the lazy dog. " \
             "the quick brown fox jumps over the lazy dog. the quick brown"
    reqs = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in range(240)]
    before = spec_llm.engine.stats().spec.num_accepted_tokens
    plain = _ids(llm_fp32.generate([prompt] * len(reqs), reqs, use_tqdm=False))
    spec = _ids(spec_llm.generate([prompt] * len(reqs), reqs, use_tqdm=False))
    assert spec_llm.engine.stats().spec.num_accepted_tokens - before > 200
    assert plain != spec   # seeded, but drawn differently: the distributions are compared, not the tokens
    for pos in range(6):
        a, b = [t[pos] for t in plain], [t[pos] for t in spec]
        common = [v for v in sorted(set(a) | set(b)) if a.count(v) + b.count(v) >= 10]
        table = [[x.count(v) for v in common] + [sum(t not in common for t in x)] for x in (a, b)]
        table = [list(r) for r in zip(*[c for c in zip(*table) if sum(c)])]
        if len(table[0]) > 1:
            assert chi2_contingency(table).pvalue > 1e-3, (pos, table)


def test_acceptance_shows_in_stats_report_and_metrics(spec_llm):
    from pagedllm.cli import kv_report
    from pagedllm.server.metrics import engine_rows

    spec_llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    s = spec_llm.engine.stats()
    assert s.spec.num_accepted_tokens > 0 and s.as_dict()["spec"]["acceptance_rate"] == s.spec.acceptance_rate
    assert "speculative decoding:" in kv_report(s) and "bytes/token" in kv_report(s)
    rows = {name: value for _, name, _, value in engine_rows(s)}
    assert rows["spec_decode_num_accepted_tokens"] == s.spec.num_accepted_tokens
    assert rows["spec_decode_acceptance_rate"] == s.spec.acceptance_rate
    assert rows["kv_cache_bytes_per_token"] == s.bytes_per_token
    assert SpecStats.total([s.spec, None, s.spec]).num_draft_tokens == 2 * s.spec.num_draft_tokens


@pytest.mark.parametrize("bad, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens must be an integer >= 1"),
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


def test_cli_flag_takes_vllm_json():
    from pagedllm.cli import build_parser, engine_config

    args = build_parser().parse_args(["generate", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'])
    assert engine_config(args).speculative_config == SpeculativeConfig("ngram", 3, 5, 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--speculative-config", '{"num_speculative_tokens": 0}'])


def test_random_proposals_never_change_greedy_output(llm_fp32, monkeypatch):
    """Drafts that are mostly wrong (random tokens, now and then the right one): the output
    is still the plain engine's, and every rejected lookahead slot is rolled back."""
    from pagedllm import LLM
    from pagedllm.runtime import ngram

    want = _ids(llm_fp32.generate(PROMPTS[3:5], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False))
    rng = random.Random(0)
    monkeypatch.setattr(ngram.NgramIndex, "propose",
                        lambda self, tokens, k: [rng.randrange(0, 50) for _ in range(rng.randint(0, k))])
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, block_size=4,
              speculative_config={"num_speculative_tokens": 6})
    got = _ids(llm.generate(PROMPTS[3:5], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False))
    assert got == want
    assert llm.engine.stats().spec.num_draft_tokens > 30 and llm.engine.kv.pool.num_used == 0
    llm.engine.kv.check_integrity()


def test_disable_by_batch_size_turns_drafts_off_in_big_batches(llm_fp32):
    """With as many sequences running as disable_by_batch_size, nobody drafts; alone, it does."""
    from pagedllm import LLM

    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512,
              speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": 3})
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([PROMPTS[2]] * 3, p, use_tqdm=False)
    assert llm.engine.stats().spec.num_drafts == 0
    got = _ids(llm.generate([PROMPTS[2]], p, use_tqdm=False))
    assert llm.engine.stats().spec.num_drafts > 0
    assert got == _ids(llm_fp32.generate([PROMPTS[2]], p, use_tqdm=False))


def test_bf16_batch_invariant_greedy_is_the_same_with_speculation(prompts):
    """In bf16 a change of batch shape moves matmul results by a rounding step, and drafts
    change the shapes; in batch-invariant mode (fixed reduction order, per row) greedy output
    with speculation is bit-for-bit the plain engine's in bf16 too. Measured: 24 of 24."""
    from pagedllm import LLM

    p = SamplingParams(temperature=0, max_tokens=48)
    outs = []
    for spec in (None, NGRAM):
        llm = LLM(dtype="bfloat16", batch_invariant=True, max_model_len=1024, kv_cache_memory="128MiB",
                  speculative_config=spec)
        outs.append(_ids(llm.generate(prompts[:10], p, use_tqdm=False)))
    assert outs[0] == outs[1]
    assert llm.engine.stats().spec.num_accepted_tokens > 20


# -- a draft model -----------------------------------------------------------------
def _derived_model(src, dst, layers: int | None = None, extra_token: str | None = None):
    """A copy of the default model: its first `layers` layers only (a smaller, worse draft),
    or with one more token in its tokenizer (a draft that must be refused)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if layers is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["num_hidden_layers"] = layers
        (dst / "config.json").write_text(json.dumps(cfg))
        w = load_file(dst / "model.safetensors")
        keep = {k: v for k, v in w.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
        save_file(keep, dst / "model.safetensors")
    if extra_token is not None:
        tok = json.loads((dst / "tokenizer.json").read_text())
        tok["model"]["vocab"][extra_token] = len(tok["model"]["vocab"])
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="module")
def small_draft(model_dir, tmp_path_factory):
    return _derived_model(model_dir, tmp_path_factory.mktemp("draft") / "first-8-layers", layers=8)


def test_draft_model_greedy_is_exact_and_rolls_back(llm_fp32, small_draft, prompts):
    """The target's first 8 layers as the draft: it proposes, the target rejects part of it,
    and greedy output is the plain engine's. Its KV pool shares the budget and the blocks."""
    from pagedllm import LLM

    llm = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=2048, block_size=8,
              speculative_config={"method": "draft_model", "model": str(small_draft), "num_speculative_tokens": 3})
    p = SamplingParams(temperature=0, max_tokens=40)
    want = _ids(llm_fp32.generate(prompts[:8], p, use_tqdm=False))
    assert _ids(llm.generate(prompts[:8], p, use_tqdm=False)) == want
    s = llm.engine.stats().spec
    assert s.num_drafts > 20 and s.num_accepted_tokens >= 5 and s.acceptance_rate < 0.95, s  # kept and rejected
    assert llm.engine.runner.draft is not None and llm.engine.kv.pool.num_used == 0
    assert llm.engine.runner.kv_cache.num_blocks < 128 * 2**20 // llm.engine.runner.kv_cache.bytes_per_block
    llm.engine.kv.check_integrity()


def test_draft_model_with_another_tokenizer_is_refused(model_dir, tmp_path):
    from pagedllm import LLM

    other = _derived_model(model_dir, tmp_path / "other-tokenizer", extra_token="<|not-ours|>")
    with pytest.raises(ValueError, match="has another tokenizer than the target"):
        LLM(dtype="float32", speculative_config={"method": "draft_model", "model": str(other),
                                                 "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs a model"):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="only it takes one"):
        EngineConfig(speculative_config={"method": "ngram", "model": str(model_dir), "num_speculative_tokens": 2})
