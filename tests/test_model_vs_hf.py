"""Our engine's greedy output equals HF transformers' on the same weights (float32),
through prefix-cache hits, chunked prefill and preemption by recompute, in the default and the
batch-invariant kernels."""
from __future__ import annotations

import torch

import hf_memo

from pagedllm import SamplingParams

SHARED = ("You are a helpful assistant for a city library. The library opens at nine, closes at six, "
          "lends books for three weeks, and charges no fines for children's books. ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    SHARED + "Question: when does the library open?",
    SHARED + "Question: how long can I keep a book?",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Write a haiku about autumn leaves falling on a quiet river at dusk:",
    "Hi",
]
MAX_NEW = 24


def hf_greedy(hf_model, ids: list[int], max_new: int) -> list[int]:
    """HF's greedy tokens, stopping at EOS (hf_memo: computed once for every test and run that
    holds the engine to the same prompt)."""
    out = hf_memo.generate(hf_model, torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                           pad_token_id=hf_model.config.eos_token_id)
    return out[0, len(ids):].tolist()


def test_greedy_matches_hf_with_prefix_hits_and_preemption(make_llm, hf_model):
    # A pool of 16 blocks x 16 tokens cannot hold all nine sequences at once, so the
    # scheduler must preempt and recompute; the shared library preamble is served
    # from the prefix cache to the second request that carries it.
    llm = make_llm(dtype="float32", num_gpu_blocks_override=16, max_model_len=512, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    st = llm.get_stats()
    assert st.preemptions > 0, "the tiny KV budget should force preemption"
    assert st.kv.prefix_hits > 0, "the shared preamble should hit the prefix cache"
    assert any(o.num_cached_tokens > 0 for o in outs[2:4])
    assert st.kv.used_blocks == 0
    llm.engine.kv.check_integrity()
    for prompt, out in zip(PROMPTS, outs):
        want = hf_greedy(hf_model, out.prompt_token_ids, MAX_NEW)
        got = out.outputs[0].token_ids
        assert got == want[:len(got)], f"{prompt[:30]!r}: ours {got} != HF {want}"
        assert len(got) == len(want) or out.outputs[0].finish_reason == "stop"


def test_logits_match_hf(hf_model, llm_fp32):
    """Prefill logits of the last token agree with HF to float32 tolerance."""
    from pagedllm.plan import ChunkPlan, SampleTarget, StepPlan

    engine = llm_fp32.engine
    ids = engine.tokenizer.encode(PROMPTS[4])
    req = engine.add_request("logits-probe", ids, SamplingParams(temperature=0, max_tokens=1))
    seq = req.seqs[0]
    engine.kv.allocate_slots(seq.seq_id, ids, len(ids))
    captured = {}
    model = engine.runner.model
    orig = model.compute_logits
    model.compute_logits = lambda h: captured.setdefault("logits", orig(h))
    try:
        table = engine.kv.block_table(seq.seq_id)
        target = SampleTarget(seq.seq_id, seq.params, seq.seed, seq.token_ids, len(ids))
        engine.runner.execute(StepPlan([ChunkPlan(seq.seq_id, 0, ids, table.slots(0, len(ids)), table.block_ids,
                                                  [target])], []))
    finally:
        model.compute_logits = orig
        engine.scheduler.waiting.remove(seq)
        engine.kv.free(seq.seq_id)
        engine.requests.pop("logits-probe")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(captured["logits"][0].float(), ref, atol=2e-3, rtol=1e-3)


def test_fp32_batch_invariant_still_matches_hf(make_llm, hf_model):
    """Batch-invariant mode (tests/test_batch_invariant.py) on the same prompts: its fixed-order
    kernels still give HF's tokens. Here, beside the test above, so that both read the one set
    of HF references this worker computes (1.6 s a prompt)."""
    llm = make_llm(dtype="float32", batch_invariant=True, num_gpu_blocks_override=16, max_model_len=512,
              max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert llm.get_stats().preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        want = hf_greedy(hf_model, out.prompt_token_ids, MAX_NEW)
        got = out.outputs[0].token_ids
        assert got == want[:len(got)], f"{prompt[:30]!r}: ours {got} != HF {want}"
