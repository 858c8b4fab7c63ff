"""Incremental detokenization equals a full decode: token by token over real text and
random ids (multi-byte characters split across tokens, special tokens), streamed text
never shows a broken character, and stop strings are found in the new text."""
from __future__ import annotations


import pytest

from pagedllm import SamplingParams

TEXTS = [
    "Hello, world! How are you today?",
    "naïve café — déjà vu, ¿qué tal? Größe",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "emoji: 🙂🚀👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and 🤖 mixed with text",
    "  leading spaces\n\ttabs and\r\nnewlines   ",
    "code: def f(x):\n    return x ** 2  # ∑ ∫ √ π",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝒎𝒂𝒕𝒉 and ᚠᛇᚻ runes, Ελληνικά, עברית, العربية",
]


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tokenizer(request, model_dir):
    from pagedllm.loader import load_tokenizer

    return load_tokenizer(model_dir) if request.param == "byte-level" else sentencepiece_like()


def sentencepiece_like():
    """A Llama-2-style tokenizer (Metaspace, byte-fallback tokens, the first space stripped)
    built here: its text depends on context, which SmolLM2's byte-level one's does not."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizer
    base.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog " * 5, TEXTS[0]],
                             trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                 initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz")))
    model = json.loads(base.to_str())["model"]
    vocab = model["vocab"]
    for i in range(256):  # byte tokens are ordinary vocabulary, as in Llama 2's
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_engine_streams_the_full_decode_and_stops_on_new_text(llm_fp32):
    engine = llm_fp32.engine
    tok = engine.tokenizer
    engine.stream_outputs = True
    try:
        req = engine.add_request("detok", "Write a line in Japanese and one with emoji: 日本語 🙂",
                                 SamplingParams(temperature=1.0, seed=3, max_tokens=48, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                c = out.outputs[0]
                full = tok.decode(c.token_ids, skip_special_tokens=True)
                assert full.startswith(c.text) and "\ufffd" not in c.text[len(full.rstrip("\ufffd")):]
        assert c.text == tok.decode(req.seqs[0].output_token_ids, skip_special_tokens=True)
    finally:
        engine.stream_outputs = False
    # A stop string spanning two tokens, found once its second token arrives.
    base = llm_fp32.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    pieces = [tok.decode([t]) for t in base.token_ids]
    k = next(i for i in range(2, len(pieces)) if pieces[i].strip() and pieces[i - 1].strip())
    stop = pieces[k - 1][-1] + pieces[k][:1]
    at = base.text.find(stop)
    for include in (False, True):
        out = llm_fp32.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                                include_stop_str_in_output=include))[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.text == base.text[:at + len(stop) * include]
