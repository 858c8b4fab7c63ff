"""Copy-on-write end to end (n samples forked off a prompt whose last block is partial)
and KVCache.copy_blocks moving exactly the blocks asked, in every layer, K and V."""
from __future__ import annotations

from hf_greedy import hf_greedy

from pagedllm import SamplingParams

MAX_NEW = 12
PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
          "mended his nets every morning and told stories to the children")


def test_n3_greedy_samples_share_a_partial_block_by_cow(hf_model, llm_fp32):
    engine = llm_fp32.engine
    B = engine.kv.block_size
    ids = engine.tokenizer.encode(PROMPT)
    ids = ids[:(len(ids) // B) * B - 3] if len(ids) % B == 0 else ids
    assert len(ids) > B and len(ids) % B != 0, "the prompt's last block must be partial"

    (one,) = llm_fp32.generate({"prompt_token_ids": ids},
                               SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                               use_tqdm=False)
    before = llm_fp32.get_stats()
    (three,) = llm_fp32.generate({"prompt_token_ids": ids},
                                 SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                                 use_tqdm=False)
    after = llm_fp32.get_stats()

    want = hf_greedy(hf_model, ids, MAX_NEW)
    assert len(want) == MAX_NEW
    assert one.outputs[0].token_ids == want
    assert len(three.outputs) == 3
    for o in three.outputs:
        assert o.token_ids == want, f"sample {o.index}: {o.token_ids} != HF {want}"
    # Two samples forked off the parent: the partial last block is shared three ways, so
    # at least the first two writers into it must copy it first.
    assert after.kv.forks - before.kv.forks == 2
    assert after.kv.cow_copies - before.kv.cow_copies >= 2
    assert after.kv.used_blocks == 0
    engine.kv.check_integrity()
