"""SamplingParams.prompt_logprobs (vLLM's): each prompt token's logprob given the tokens
before it, computed in the prefill, against HF transformers' full forward; and served from
the prefix cache, where each full block keeps its tokens' logprobs beside its KV: equal,
token for token, to recomputing them (fp32, batch-invariant: bit for bit)."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling_params import SamplingParams

TEXT = ("The library lends loose-leaf pages to readers. Readers of the same book share pages, and a page is "
        "copied only before someone writes on it. ") * 4


@pytest.fixture(scope="module")
def chunky(make_llm):
    """Prompts prefilled 48 tokens a step, in a pool small enough to preempt."""

    return make_llm(dtype="float32", max_model_len=1024, max_num_batched_tokens=48, num_gpu_blocks_override=40,
               block_size=8)


def _exact(make_llm, caching: bool):
    """fp32, batch-invariant: a row's logits do not depend on the rest of its step, so the
    cache's entries and a recomputation can be compared bit for bit."""

    return make_llm(dtype="float32", max_model_len=256, num_gpu_blocks_override=48, block_size=8, batch_invariant=True,
               enable_prefix_caching=caching)


@pytest.fixture(scope="module")
def cached(make_llm):
    return _exact(make_llm, True)


@pytest.fixture(scope="module")
def uncached(make_llm):
    return _exact(make_llm, False)


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


def test_prompt_logprobs_survive_preemption(chunky, hf_model):
    """Beside longer requests in a tight pool, a preempted prompt scores no token twice and
    leaks no block; what it takes from the cache after resuming is its own prefix's."""
    chunky.engine.kv.reset_prefix_cache()
    params = [SamplingParams(max_tokens=90, ignore_eos=True)] * 3 + [SamplingParams(max_tokens=60, prompt_logprobs=0,
                                                                                     ignore_eos=True)]
    outs = chunky.generate([TEXT + " One.", TEXT + " Two.", TEXT + " Three.", "Counting: " + TEXT], params,
                           use_tqdm=False)
    assert chunky.engine.stats().preemptions > 0
    out = outs[3]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids)
    ref = _hf_logprobs(hf_model, ids)
    assert max(abs(out.prompt_logprobs[i][ids[i]].logprob - float(ref[i - 1, ids[i]])) for i in range(1, len(ids))) < 2e-3
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])   # k = 0: the prompt token alone
    assert chunky.engine.kv.pool.num_used == 0
    chunky.engine.kv.check_integrity()


def _run(llm, prompts: list[str], k: int, salt: str | None = None) -> list:
    """Each prompt its own request, one after the other (a later one may hit an earlier
    one's blocks), as RequestOutputs."""
    outs = []
    for p in prompts:
        req = llm.engine.add_request(None, p, SamplingParams(max_tokens=1, prompt_logprobs=k), cache_salt=salt)
        got = []
        while llm.engine.has_unfinished_requests():
            got += [o for o in llm.engine.step() if o.request_id == req.request_id and o.finished]
        outs.append(got[-1])
    return outs


def _same(a, b) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
    for i, (x, y) in enumerate(zip(a.prompt_logprobs, b.prompt_logprobs)):
        assert x == y, f"prompt token {i}: {x} != {y}"   # same ids in the same order, same floats and ranks


SHORT = TEXT[:200]
PROMPTS = [SHORT + " Which page is copied?",                 # computes and keeps its blocks' logprobs
           SHORT + " Which readers share the pages, and why?",  # shares whole blocks, then a partial last block
           SHORT + " Which readers share the pages, and why?",  # the same prompt: every block but the last hit
           SHORT[:150]]                                      # a prompt inside the others' blocks


def test_cached_prompt_logprobs_equal_recomputed(cached, uncached):
    """Hits across block boundaries, at a partial last block, a smaller top k served from a
    larger one, and the counters: KV hits and prompt-logprob hits apart."""
    before = cached.engine.stats()
    on = _run(cached, PROMPTS, 5)
    after = cached.engine.stats()
    on_top2 = _run(cached, PROMPTS[:2], 2)      # top 2 of the kept top 20, before another engine runs
    top2_hits = cached.engine.stats().kv.scores.hits - after.kv.scores.hits
    off, off_top2 = _run(uncached, PROMPTS, 5), _run(uncached, PROMPTS[:2], 2)
    for a, b in zip(on, off):
        _same(a, b)
    assert on[1].num_cached_tokens >= 40 and on[2].num_cached_tokens == (len(on[2].prompt_token_ids) - 1) // 8 * 8
    kv = after.kv
    served = kv.scores.hits - before.kv.scores.hits
    assert served >= on[1].num_cached_tokens - 1 + on[2].num_cached_tokens - 1
    assert kv.scores.queries - before.kv.scores.queries == sum(len(o.prompt_token_ids) - 1 for o in on)
    assert kv.scores.entries > 0
    # Computed prompt rows: a hit costs one row (the last cached position scores the next token).
    assert after.computed_prompt_tokens - before.computed_prompt_tokens < sum(len(o.prompt_token_ids) for o in on) - served + 4
    assert top2_hits >= on_top2[1].num_cached_tokens - 1 > 0
    for a, b in zip(on_top2, off_top2):
        _same(a, b)
        assert all(len(e) <= 3 for e in a.prompt_logprobs[1:])
    cached.engine.kv.check_integrity()


def test_kept_logprobs_follow_the_salt_and_the_blocks(cached, uncached):
    """A salt that must not share gets nothing of another's entries; a block computed without
    logits is scored again from there (its KV still a hit); an evicted block's entry is gone."""
    ref = _run(uncached, [PROMPTS[1]], 3)[0]
    _run(cached, [PROMPTS[1]], 3)                         # unsalted: kept
    hits = cached.engine.stats().kv.scores.hits
    salted = _run(cached, [PROMPTS[1]], 3, salt="tenant-b")[0]
    _same(salted, ref)
    assert salted.num_cached_tokens == 0 and cached.engine.stats().kv.scores.hits == hits
    again = _run(cached, [PROMPTS[1]], 3, salt="tenant-b")[0]   # its own salt: its own entries
    _same(again, ref)
    assert cached.engine.stats().kv.scores.hits > hits

    plain = "Plain requests keep no logprobs: " + SHORT
    cached.generate([plain], SamplingParams(max_tokens=1), use_tqdm=False)
    hits = cached.engine.stats().kv.scores.hits
    scored = _run(cached, [plain], 3)[0]
    assert scored.num_cached_tokens > 0 and cached.engine.stats().kv.scores.hits == hits
    _same(scored, _run(uncached, [plain], 3)[0])
    _same(_run(cached, [plain], 3)[0], scored)            # now kept: served

    # Evict everything cached: 48 blocks of 8 tokens, filled by other prompts.
    for i in range(4):
        cached.generate([f"Filler {i}: " + TEXT[:500]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert cached.engine.stats().kv.pool.evictions > 0
    assert cached.engine.kv.lookup_prefix(cached.engine.rules.tokenize(PROMPTS[1], True)[1]) == []
    assert not cached.engine.kv.scores.entries.keys() - cached.engine.kv.pool.cached.keys()
    _same(_run(cached, [PROMPTS[1]], 3)[0], ref)
    cached.engine.kv.check_integrity()


def test_prompt_at_max_model_len_is_exact(cached, uncached, hf_model):
    """A prompt of max_model_len - 1 tokens with prompt logprobs and one output token."""
    ids = cached.engine.rules.tokenize(TEXT * 3, True)[1][:255]
    outs = []
    for llm in (cached, uncached, cached):   # the second on `cached` is served from its blocks
        req = llm.engine.add_request(None, ids, SamplingParams(max_tokens=1, prompt_logprobs=1))
        got = []
        while llm.engine.has_unfinished_requests():
            got += [o for o in llm.engine.step() if o.request_id == req.request_id and o.finished]
        outs.append(got[-1])
    _same(outs[0], outs[1])
    _same(outs[2], outs[1])
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 1
    ref = _hf_logprobs(hf_model, ids)
    assert max(abs(outs[0].prompt_logprobs[i][ids[i]].logprob - float(ref[i - 1, ids[i]])) for i in range(1, 255)) < 2e-3


def test_prompt_logprob_logits_go_by_chunk(chunky, monkeypatch):
    """A long prompt's rows are scored SCORE_ROWS at a time, never the whole prompt's
    float32 logits at once."""
    from pagedllm.runtime import prompt_scores

    runner = chunky.engine.runner
    rows: list[int] = []
    real = runner.model.compute_logits
    monkeypatch.setattr(prompt_scores, "SCORE_ROWS", 16)
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: rows.append(h.shape[0]) or real(h))
    chunky.engine.kv.reset_prefix_cache()
    out = chunky.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=20), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and max(rows) <= 16 and len(rows) > 8


def test_bad_prompt_logprobs_are_refused(chunky):
    for bad in (-1, 2.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer >= 0"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match=r"prompt_logprobs: 21 is more than .*max_logprobs 20"):
        chunky.generate(["Hello"], SamplingParams(prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logprobs: 30 is more than .*max_logprobs 20"):
        chunky.generate(["Hello"], SamplingParams(logprobs=30), use_tqdm=False)
    assert chunky.engine.kv.pool.num_used == 0


def test_requests_arriving_together_compute_a_shared_context_once(cached, uncached):
    """Choices of one question arrive at once: the first computes the shared context and keeps
    its logprobs; the others wait that step and take them from the cache (not computing it twice)."""
    context = "Question: which blocks does a reader share with another? " + TEXT[:300] + " Answer:"
    prompts = [context + c for c in (" A", " B", " C", " D")]
    before = cached.engine.stats().computed_prompt_tokens
    reqs = [cached.engine.add_request(None, p, SamplingParams(max_tokens=1, prompt_logprobs=1)) for p in prompts]
    done = {}
    while cached.engine.has_unfinished_requests():
        done.update({o.request_id: o for o in cached.engine.step() if o.finished})
    computed = cached.engine.stats().computed_prompt_tokens - before
    n = len(done[reqs[0].request_id].prompt_token_ids)
    assert computed < n + 3 * 12, f"{computed} prompt rows computed for 4 prompts of {n} sharing all but the last"
    for req, ref in zip(reqs, _run(uncached, prompts, 1)):
        _same(done[req.request_id], ref)
