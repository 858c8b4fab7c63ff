"""The llama3_json, mistral, pythonic and qwen3_coder tool parsers on transcripts in each
family's own format (as the models write them), whole and streamed in every split; what does
not read as calls stays content."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.server.parsers.tool_calls import TOOL_PARSERS, CallPart, parse_all

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
             "tz": {"type": "string"}}}}}]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"tz": "UTC"})

CASES = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', [WEATHER], ""),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"tz": "UTC"}}', [WEATHER, TIME], ""),
    ("llama3_json", "It is sunny in Paris.", [], "It is sunny in Paris."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', [], '{"name": "get_weather", "parameters": {"city": "Par'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"tz": "UTC"}}]', [WEATHER, TIME], ""),
    ("mistral", 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
                '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', [WEATHER, TIME], "Let me check."),
    ("mistral", "No tools needed: 4.", [], "No tools needed: 4."),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(tz="UTC")]', [WEATHER, TIME], ""),
    ("pythonic", "[1] is a citation, not a call.", [], "[1] is a citation, not a call."),
    ("pythonic", '[__import__("os").system("rm -rf /")]', [], '[__import__("os").system("rm -rf /")]'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", [WEATHER], ""),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=zip>\n75001\n</parameter>\n"
                    "</function>\n</tool_call>", [("get_weather", {"zip": "75001"})], "Checking."),
]


def _read(events) -> tuple[list, str]:
    calls, content, open_call = [], "", None
    for e in events:
        if isinstance(e, str):
            content += e
        elif e.name is not None:
            open_call = [e.name, e.arguments]
            calls.append(open_call)
        else:
            open_call[1] += e.arguments
    return [(n, json.loads(a)) for n, a in calls], content


@pytest.mark.parametrize("name, text, calls, content", CASES)
def test_transcripts(name, text, calls, content):
    assert _read(parse_all(TOOL_PARSERS[name](tools=TOOLS), text)) == (calls, content)


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_streamed_in_any_pieces_equals_whole(case, cuts):
    name, text, calls, content = case
    parser = TOOL_PARSERS[name](tools=TOOLS)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    events = [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])] + parser.end()
    assert _read(events) == (calls, content)


def test_a_string_parameter_keeps_its_digits():
    """qwen3_coder types values by the schema: "75001" stays a string where the tool says so."""
    (call,) = parse_all(TOOL_PARSERS["qwen3_coder"](tools=TOOLS), "<tool_call><function=get_weather>"
                        "<parameter=zip>75001</parameter><parameter=days>2</parameter></function></tool_call>")
    assert isinstance(call, CallPart) and json.loads(call.arguments) == {"zip": "75001", "days": 2}
