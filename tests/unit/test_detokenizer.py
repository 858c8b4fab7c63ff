"""Incremental detokenization equals a full decode: token by token over real text and
random ids (multi-byte characters split across tokens, special tokens), streamed text
never shows a broken character, and stop strings are found in the new text."""
from __future__ import annotations

import random

import pytest

from pagedllm.engine.detokenizer import DetokState, detokenize, final_text

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


def cases(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    out = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    specials = list(tokenizer.all_special_ids)
    out += [rng.sample(specials, 1) + ids + rng.sample(specials, 1) for ids in out[:len(TEXTS)]]
    # Cut real text at every point: the output ends inside a multi-byte character.
    out += [ids[:k] for ids in out[1:4] for k in range(1, len(ids))]
    if tokenizer.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel":
        # Random ids: characters begun and never finished, mid-text. (A ByteFallback decoder
        # turns a whole byte run into U+FFFDs when any of it is broken, rewriting text already
        # streamed; vLLM's incremental decoding shares that, and models emit valid UTF-8.)
        out += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))] for _ in range(60)]
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_full_decode(tokenizer, skip):
    prompt = tokenizer.encode("A prompt before the output:", add_special_tokens=False)
    for out_ids in cases(tokenizer):
        ids, state, text = list(prompt), DetokState(), ""
        final = tokenizer.decode(out_ids, skip_special_tokens=skip)
        for i, t in enumerate(out_ids):
            ids.append(t)
            text += detokenize(tokenizer, ids, len(prompt), state, skip)
            full = tokenizer.decode(out_ids[:i + 1], skip_special_tokens=skip)
            if "\ufffd" not in full:
                assert text == full, (out_ids[:i + 1], text, full)
            if "\ufffd" not in final:
                assert final.startswith(text), "streamed text is not where the output goes"
        assert final_text(tokenizer, ids, len(prompt), state, skip, text) == tokenizer.decode(
            out_ids, skip_special_tokens=skip)


def test_decoding_work_per_token_is_bounded(tokenizer, monkeypatch):
    """Each step decodes a window of a few ids, never the whole output (O(n) in all)."""
    ids = tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    decoded: list[int] = []
    real = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda x, **kw: (decoded.append(len(x)), real(x, **kw))[1])
    state, text = DetokState(), ""
    for i in range(len(ids)):
        text += detokenize(tokenizer, ids[:i + 1], 0, state, True)
    assert text == real(ids, skip_special_tokens=True)
    assert len(ids) > 300 and max(decoded) <= 12
