"""gpt-oss's harmony format (server/parsers/harmony.py) on transcripts of its real form: reasoning
in the analysis channel, the answer in the final one, tool calls as commentary messages to
functions.NAME (the recipient before or after the channel, a preamble before them, several in a
row), a built-in tool's request, plain text, and outputs cut short. Whole and streamed in any
pieces agree, for the reasoning parser, the tool parser, and the two chained as the server runs them."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.server.parsers.base import CallPart, parse_all
from pagedllm.server.parsers.reasoning import REASONING_PARSERS, split_all
from pagedllm.server.parsers.tool_calls import TOOL_PARSERS

WEATHER = ('<|channel|>analysis<|message|>User asks for the weather in Paris. Call get_weather.<|end|>'
           '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city": "Paris"}<|call|>')
# the recipient in the role's part of the header, a preamble to the user first, two calls
TWO_CALLS = ('<|channel|>analysis<|message|>Need both.<|end|>'
             '<|start|>assistant<|channel|>commentary<|message|>Checking both cities.<|end|>'
             '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
             '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>')
FINAL = ('<|channel|>analysis<|message|>Simple arithmetic: 2 + 2 = 4.<|end|>'
         '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>')
BROWSER = ('<|channel|>analysis<|message|>Search.<|end|>'
           '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>')

# (text, reasoning, content after the reasoning parser, the tool parser's events of the raw text)
CASES = [
    (WEATHER, "User asks for the weather in Paris. Call get_weather.",
     '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>',
     [CallPart("get_weather", '{"city": "Paris"}')]),
    (TWO_CALLS, "Need both.",
     'Checking both cities.<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>'
     '<|channel|>commentary to=functions.get_time<|message|>{"tz": "CET"}<|call|>',
     ["Checking both cities.", CallPart("get_weather", '{"city": "Oslo"}'), CallPart("get_time", '{"tz": "CET"}')]),
    (FINAL, "Simple arithmetic: 2 + 2 = 4.", "2 + 2 = 4.", ["2 + 2 = 4."]),
    ("The capital of France is Paris.", "", "The capital of France is Paris.", ["The capital of France is Paris."]),
    ("<|channel|>analysis<|message|>Cut sho", "Cut sho", "", []),
    ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa',
     "", '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa', ['{"city": "Pa']),
    (BROWSER, "Search.", '<|channel|>commentary to=browser.search<|message|>{"query": "x"}<|call|>',
     ['{"query": "x"}']),
    ("<|chan", "", "", []),
]


def _merged(events):
    """Consecutive content strings joined: how pieces split content is the stream's business."""
    out = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e)
    return out


@pytest.mark.parametrize("text, reasoning, content, events", CASES)
def test_whole_transcripts(text, reasoning, content, events):
    assert split_all(REASONING_PARSERS["openai_gptoss"](), text) == (reasoning, content)
    assert _merged(parse_all(TOOL_PARSERS["openai"](), text)) == events
    # the server's chain: the tool parser reads the reasoning parser's answer, and finds the same calls
    calls = [e for e in events if isinstance(e, CallPart)]
    assert [e for e in parse_all(TOOL_PARSERS["openai"](), content) if isinstance(e, CallPart)] == calls


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 240), max_size=14))
def test_streamed_in_any_pieces_equals_whole(case, cuts):
    text, reasoning, content, events = case
    splitter, tools = REASONING_PARSERS["openai_gptoss"](), TOOL_PARSERS["openai"]()
    got_r, got_c, got_e = "", "", []
    for piece in _pieces(text, cuts):
        r, c = splitter.feed(piece)
        got_r, got_c = got_r + r, got_c + c
        got_e += tools.feed(piece)
    r, c = splitter.end()
    assert (got_r + r, got_c + c) == (reasoning, content)
    assert _merged(got_e + tools.end()) == events


def test_the_grammar_waits_for_the_final_channel_and_the_tags_are_kept():
    parser = REASONING_PARSERS["openai_gptoss"]()
    assert parser.answer_start == "<|channel|>final<|message|>"
    assert not parser.closed_by("<|start|>assistant")
    assert {"<|channel|>", "<|message|>", "<|call|>"} <= set(parser.tags) == set(TOOL_PARSERS["openai"].tags)
