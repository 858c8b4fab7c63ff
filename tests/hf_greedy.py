"""Greedy tokens of a transformers model, the reference our engine's tokens are held to."""
from __future__ import annotations


def hf_greedy(hf, ids: list[int], new: int) -> list[int]:
    """`new` greedy tokens after `ids` from transformers' generate (EOS not stopping it), computed
    once per machine and versions (hf_memo)."""
    import torch

    import hf_memo

    out = hf_memo.generate(hf, torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_greedy_matches(llm, hf, prompts: list[list[int]], new: int) -> None:
    """The engine `llm`'s greedy tokens for each prompt equal transformers' `hf`'s."""
    from pagedllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, new), ids
