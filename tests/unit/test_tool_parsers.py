"""Reading tool calls from a choice's text: the hermes parser, a forced call's JSON, and the
OpenAI shapes they become, whole and streamed (no server, no model)."""
from __future__ import annotations

import json

import pytest

from pagedllm.server.openai.tool_output import ToolOutput
from pagedllm.server.parsers.tool_calls import TOOL_PARSERS, CallPart, HermesParser, parse_all

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC <b>"}}</tool_call>'


def _content(events) -> str:
    return "".join(e for e in events if isinstance(e, str))


def test_registry_names_hermes():
    assert TOOL_PARSERS["hermes"] is HermesParser


def test_plain_text_is_content():
    assert parse_all(HermesParser(), "  The weather is fine.\n") == ["The weather is fine."]
    assert parse_all(HermesParser(), "a < b, and <tool is not a tag") == ["a < b, and <tool is not a tag"]


def test_one_call_with_text_around_it():
    events = parse_all(HermesParser(), "Let me look.\n" + WEATHER + "\nDone.")
    assert events[0] == "Let me look."
    assert events[1] == CallPart("get_weather", json.dumps({"city": "Paris", "unit": "c"}))
    assert events[2:] == ["\n\nDone."]  # the layout between content pieces stays; its ends go


def test_two_calls():
    calls = [e for e in parse_all(HermesParser(), WEATHER + "\n" + TIME) if isinstance(e, CallPart)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "UTC <b>"})]


def test_broken_json_stays_content():
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    events = parse_all(HermesParser(), "Hi " + broken + WEATHER)
    assert _content(events) == "Hi " + broken
    assert [e.name for e in events if isinstance(e, CallPart)] == ["get_weather"]
    for not_a_call in ('<tool_call>["not", "a call"]</tool_call>',
                       '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>'):
        assert parse_all(HermesParser(), not_a_call) == [not_a_call]


def test_call_left_open_at_the_end():
    events = parse_all(HermesParser(), 'ok <tool_call>{"name": "f", "arguments": {}}')
    assert events == ["ok", CallPart("f", "{}")]
    cut = 'ok <tool_call>{"name": "f", "argu'
    assert _content(parse_all(HermesParser(), cut)) == cut
    assert _content(parse_all(HermesParser(), "ok <tool_")) == "ok <tool_"


def _streamed(out: ToolOutput, pieces: list[str]) -> tuple[str, list[dict]]:
    """Content and whole calls from streaming `pieces` through one choice's reader."""
    reader = out.stream()
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, ds = reader.feed(piece)
        if i == len(pieces) - 1:
            rest, more = reader.end()
            text, ds = text + rest, ds + more
        content += text
        deltas += ds
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:  # a call's first delta carries its id, type and name
            assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        else:
            assert "name" not in d["function"]
        calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def _whole(out: ToolOutput, text: str) -> tuple[str | None, list[dict]]:
    msg, _ = out.message(text, "stop")
    return msg["content"], [dict(c["function"]) for c in msg.get("tool_calls", [])]


@pytest.mark.parametrize("text", [
    "Plain answer, no calls.",
    "Let me look.\n" + WEATHER + "\nand\n" + TIME + "  ",
    "x <tool_call>{bad}</tool_call> y " + WEATHER,
])
def test_stream_split_anywhere_equals_whole(text):
    out = ToolOutput("auto", parser=HermesParser)
    content, calls = _whole(out, text)
    for cut in range(1, len(text)):  # every two-piece split, tags cut anywhere
        got_content, got_calls = _streamed(out, [text[:cut], text[cut:]])
        assert (got_content or None, got_calls) == (content or None, calls), cut
    assert _streamed(out, list(text)) == (content or "", calls)  # a character at a time


def test_auto_message_shape_and_finish_reason():
    out = ToolOutput("auto", parser=HermesParser)
    msg, finish = out.message(WEATHER, "stop")
    assert msg["content"] is None and finish == "tool_calls"
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert out.message("no call", "stop") == ({"role": "assistant", "content": "no call"}, "stop")
    assert out.message(WEATHER, "length")[1] == "length"  # cut short: may have lost a call


def test_parallel_false_keeps_the_first_call():
    out = ToolOutput("auto", parser=HermesParser, parallel=False)
    msg, _ = out.message(WEATHER + TIME, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Pa]r}is\\""}}, {"name": "get_time", "parameters": {}}]'


def test_required_array_to_calls():
    out = ToolOutput("required")
    msg, finish = out.message(REQUIRED, "stop")
    assert msg["content"] is None and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": 'Pa]r}is"'}), ("get_time", {})]
    for cut in range(1, len(REQUIRED)):
        assert _streamed(out, [REQUIRED[:cut], REQUIRED[cut:]]) == ("", _whole(out, REQUIRED)[1]), cut


def test_required_cut_short_or_not_an_array():
    out = ToolOutput("required")
    msg, finish = out.message(REQUIRED[:80], "length")
    assert finish == "length" and [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert msg["content"] == REQUIRED[REQUIRED.index('{"name": "get_time"'):80]
    assert out.message("I will not.", "stop") == ({"role": "assistant", "content": "I will not."}, "stop")


def test_named_call_streams_its_arguments():
    out = ToolOutput("named", name="get_weather")
    msg, finish = out.message('{"city": "Paris"}', "stop")
    assert msg["content"] is None and finish == "stop"  # a forced function ends as any answer does
    assert [dict(c["function"]) for c in msg["tool_calls"]] == [{"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}]
    reader = out.stream()
    first, second = reader.feed('{"city"')[1], reader.feed(': "Paris"}')[1]
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"city"'} and "id" in first[0]
    assert second == [{"index": 0, "function": {"arguments": ': "Paris"}'}}]


def test_named_call_cut_short_is_content():
    msg, finish = ToolOutput("named", name="f").message('{"city": "Par', "length")
    assert msg == {"role": "assistant", "content": '{"city": "Par'} and finish == "length"
