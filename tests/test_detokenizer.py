"""Detokenization in the engine: streamed text never shows a broken character, and stop
strings are found in the new text (the detokenizer alone: tests/unit/test_detokenizer.py)."""
from __future__ import annotations

from pagedllm import SamplingParams


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
