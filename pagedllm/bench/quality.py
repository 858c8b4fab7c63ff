"""Output quality figures: perplexity of a fixed text through the engine (prompt logprobs),
and the common prefix of two greedy runs."""
from __future__ import annotations

import math
from itertools import islice


def fixed_text_ids(tokenizer, num_tokens: int) -> list[int]:
    """A fixed English text: the first ShareGPT replies in file order, joined, cut to
    num_tokens tokens (BOS first). The same ids on every machine with the dataset."""
    from .sharegpt import iter_records

    parts: list[str] = []
    n = 0
    for rec in islice(iter_records(), 200):
        conv = rec.get("conversations", [])
        for turn in conv[1:2]:
            if turn.get("from") == "gpt" and turn.get("value", "").isascii():
                parts.append(turn["value"])
                n += len(turn["value"]) // 3
        if n > num_tokens * 2:
            break
    ids = tokenizer.encode("\n\n".join(parts), add_special_tokens=False)[:num_tokens - 1]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids


def perplexity(llm, token_ids: list[int]) -> float:
    """exp(mean negative logprob) of each token after the first, given those before it."""
    from ..sampling_params import SamplingParams

    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    lps = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(token_ids) if i > 0]
    return math.exp(-sum(lps) / len(lps))


def common_prefix(a: list[list[int]], b: list[list[int]], n: int) -> tuple[float, int]:
    """Mean length of the common prefix of paired outputs (capped at n), and how many pairs
    agree on all n tokens."""
    same = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), n) for p, q in zip(a, b)]
    return sum(same) / len(same), sum(s == n for s in same)
