"""Batch-invariant mode (--batch-invariant): a request's greedy tokens in bf16 are the same
run alone, in any batch, and after preemption and recompute; and the pieces that make it
so (matmuls, attention) give a row the same bits whatever else is in the call."""
from __future__ import annotations

import random

from hw import FAST_DTYPE, NATIVE_BF16

from pagedllm import LLM, SamplingParams


# ShareGPT-like: questions, instructions, pasted text and code, many short, a few long.
SENTENCES = [
    "Can you explain how photosynthesis works in simple terms?",
    "Write a short story about a robot who learns to paint.",
    "The quarterly report shows revenue growth of twelve percent, driven mostly by new customers in Europe.",
    "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()",
    "I am planning a trip to Japan in April; which cities should I visit for the cherry blossoms?",
    "Translate the following sentence into French: the weather is lovely today.",
    "Our team migrated the database last night and some queries are now three times slower.",
    "What are the main differences between TCP and UDP, and when would you use each?",
    "Summarize the plot of a novel in which two families feud over a river for a hundred years.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10 ORDER BY 2 DESC;",
    "My tomato plants have yellow leaves at the bottom; is that a watering problem or a disease?",
    "Please draft a polite email asking my landlord to fix the heating before the winter starts.",
    "In 1848 revolutions spread across Europe, and within months several monarchies granted constitutions.",
    "Give me three ideas for a birthday party for a seven-year-old who loves dinosaurs.",
]


def sharegpt_like(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts as token ids: mostly short, a fifth long enough to cross several KV blocks,
    some past 512 tokens (the attention kernel's key chunk)."""
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(4, 40), rng.randint(40, 200), rng.randint(500, 700)]) for _ in range(n)]
    prompts = []
    for length in lengths:
        text = ""
        while len(tokenizer.encode(text, add_special_tokens=False)) < length:
            text += rng.choice(SENTENCES) + ("\n\n" if rng.random() < 0.3 else " ")
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[:length])
    return prompts


def batch_vs_alone(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, dict]:
    """Requests whose greedy tokens in one batch equal their run alone (each alone run
    starts from an empty prefix cache: nothing computed in the batch is reused), and the
    batch's engine counters."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = llm.generate(prompts, sp, use_tqdm=False)
    stats = llm.get_stats().as_dict()
    alone = []
    for p in prompts:
        llm.reset_prefix_cache()
        alone.append(llm.generate([p], sp, use_tqdm=False)[0])
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(alone, batch))
    return same, stats


def test_bf16_greedy_same_alone_and_in_a_preempting_batch(make_llm, tiny_model):
    # 100 blocks of 16 tokens cannot hold every long prompt at once: the batch preempts and
    # recomputes; 256-token steps chunk the long prompts beside other requests' decodes;
    # prompts that start alike share prefix blocks. Without the mode 10 of these 12 match
    # (measured in bf16 at 18 tokens; 12 prompts, not 32, and 18 tokens, not 24: each also runs
    # alone, and 32 x 24 took 84 s of the suite, 16 x 18 36 s).
    # Where the CPU emulates bf16 the check runs in fp32 (FAST_DTYPE), on 6 prompts and 48 blocks
    # (2 long ones: it still preempts and hits; there all of them match with the mode off too,
    # so the bf16 machines are the ones this test's numerics are for; there, being a check of
    # the mechanism only, it runs on the tiny model).
    n, blocks, tokens = (12, 100, 18) if NATIVE_BF16 else (6, 48, 12)
    llm = make_llm(model=None if NATIVE_BF16 else tiny_model, dtype=FAST_DTYPE, batch_invariant=True, num_gpu_blocks_override=blocks, max_num_batched_tokens=256,
                   max_model_len=1024)
    assert "batch-invariant" in llm.engine.runner.describe()
    prompts = sharegpt_like(llm.tokenizer, n)
    assert max(map(len, prompts)) > 512 and min(map(len, prompts)) < 40
    same, stats = batch_vs_alone(llm, prompts, tokens)
    assert stats["preemptions"] > 0, "the small pool should force preemption"
    assert stats["kv"]["prefix_hits"] > 0, "prompts that start alike should hit the prefix cache"
    assert same == len(prompts), f"only {same}/{len(prompts)} requests gave the same tokens in the batch as alone"
    llm.engine.kv.check_integrity()


# --- the pieces --------------------------------------------------------------
