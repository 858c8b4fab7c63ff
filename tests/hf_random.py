"""Random-weight models of a family's layout, built with transformers' own classes and saved for our
engine to load, and the eight prompts their HF-parity tests run (short ones, one that chunks over
several blocks, two that share a 72-token stem)."""
from __future__ import annotations

import shutil

STEM = list(range(300, 372))
PROMPTS = [[5, 17, 300, 4000, 12], list(range(100, 190)), STEM + [7, 8, 9], STEM + [11, 12],
           [42] * 3, list(range(1000, 1033)), [9, 99, 999, 9999], list(range(2000, 2016))]


def save_with_tokenizer(model, out, model_dir):
    """`model` saved as safetensors in `out`, with the default model's tokenizer (any tokenizer of
    the same vocabulary will do). Returns `out`."""
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)
    return out


def check_greedy_and_prompt_logprobs(llm, hf, hf_tokens: list[list[int]]) -> None:
    """All of PROMPTS at once through `llm`: greedy tokens equal `hf_tokens` (HF's), the second
    prompt's logprobs HF's within 1e-3."""
    import torch

    from pagedllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = torch.tensor([outs[1].prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-3, rtol=0)


_BUILT: dict[str, tuple] = {}


def built(name: str, make, tmp_path_factory, model_dir) -> tuple:
    """(HF model, its directory) of make(), made and saved once per run under `name`."""
    if name not in _BUILT:
        model = make()
        _BUILT[name] = model, save_with_tokenizer(model, tmp_path_factory.mktemp(name), model_dir)
    return _BUILT[name]


def hf_tokens_of(hf) -> list[list[int]]:
    """HF's 32 greedy tokens after each of PROMPTS."""
    from hf_greedy import hf_greedy

    return [hf_greedy(hf, ids, 32) for ids in PROMPTS]


def check_prefix_hit(llm, hf_tokens: list[list[int]]) -> None:
    """PROMPTS[3] after PROMPTS[2] (their 72-token stem: four whole blocks of 16) reads the cached
    blocks, and both give HF's tokens."""
    from pagedllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kv = llm.engine.kv
    assert llm.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0].token_ids == hf_tokens[2]
    before = kv.prefix_hits
    assert llm.generate([PROMPTS[3]], greedy, use_tqdm=False)[0].outputs[0].token_ids == hf_tokens[3]
    assert kv.prefix_hits - before == 72 // 16 * 16
    kv.check_integrity()
