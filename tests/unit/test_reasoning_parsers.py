"""The reasoning parsers on real-format transcripts: DeepSeek-R1's (the template opened the
block) and Qwen3's (the model opens it, or answers without one), whole and streamed in
every split, which must agree."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.server.parsers.reasoning import REASONING_PARSERS, split_all

R1 = ("Okay, the user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n</think>\n\n"
      "17 × 23 = **391**.")
QWEN3 = ("<think>\nThe user wants the capital of France. That is Paris.\n</think>\n\nThe capital of France is Paris.")
QWEN3_NO_THINKING = "The capital of France is Paris."

CASES = [
    ("deepseek_r1", R1, "Okay, the user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n",
     "17 × 23 = **391**."),
    ("deepseek_r1", "<think>" + R1, "Okay, the user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n",
     "17 × 23 = **391**."),
    ("deepseek_r1", "Still thinking when max_tokens cut it", "Still thinking when max_tokens cut it", ""),
    ("qwen3", QWEN3, "\nThe user wants the capital of France. That is Paris.\n", "The capital of France is Paris."),
    ("qwen3", QWEN3_NO_THINKING, "", QWEN3_NO_THINKING),
    ("qwen3", "<think>\ncut short", "\ncut short", ""),
    ("qwen3", "<thin", "", "<thin"),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_whole_transcripts(name, text, reasoning, content):
    assert split_all(REASONING_PARSERS[name](), text) == (reasoning, content)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_in_any_pieces_equals_whole(case, cuts):
    name, text, reasoning, content = case
    parser = REASONING_PARSERS[name]()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    got_r, got_c = "", ""
    for a, b in zip(bounds, bounds[1:]):
        r, c = parser.feed(text[a:b])
        got_r, got_c = got_r + r, got_c + c
    r, c = parser.end()
    assert (got_r + r, got_c + c) == (reasoning, content)
