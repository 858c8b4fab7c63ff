"""Structured outputs and tool calls through the OpenAI API, end to end: a real server (with
--enable-auto-tool-choice --tool-call-parser hermes) driven by the official openai client,
the default SmolLM2-135M under greedy decoding. The engine constrains every token, so
whatever this small model thinks, the output parses."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from .conftest import MODEL

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
               "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": TIME_PARAMS}}]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}


@pytest.fixture(scope="module")
def client(tool_server):
    return tool_server.openai(api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return server.client().post(path, json={"model": MODEL, **body}, timeout=120)


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    degrees: int
    sunny: bool


def test_parse_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Forecast, max_tokens=60,
                                      temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Forecast), msg.content
    assert Forecast.model_validate_json(msg.content) == msg.parsed


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _streamed_calls(chunks) -> tuple[list[tuple[str, dict]], str | None, str]:
    """Reassemble streamed tool-call deltas: (calls, last finish_reason, content)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: its id, type and name
                    assert d.index not in calls and d.type == "function" and d.id.startswith("chatcmpl-tool-")
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish, content


def test_tool_choice_required(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice.message)
    assert calls and all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
    for name, args in calls:
        jsonschema.validate(args, PARAMS[name])
    streamed, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert (streamed, finish, content) == (calls, "tool_calls", "")


def test_named_tool_choice(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # vLLM's, OpenAI's
    [(name, args)] = _calls(choice.message)
    assert name == "get_time"
    jsonschema.validate(args, TIME_PARAMS)
    streamed, finish, _ = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert (streamed, finish) == ([(name, args)], "stop")


def test_auto_tool_choice_reads_hermes_calls(client):
    # The small model would rarely write a call by itself: a regex makes it write one, which
    # the hermes parser then reads out of the free text (auto plus a constraint, as vLLM allows).
    regex = r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}</tool_call>'
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [(name, args)] = _calls(choice.message)
    assert name == "get_weather" and args["city"] in ("Paris", "Oslo")
    streamed, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert (streamed, finish, content) == ([(name, args)], "tool_calls", "Checking.")


def test_tool_choice_none_and_tool_messages(client):
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_guided_choice_regex_and_schema_on_both_endpoints(client, tool_server):
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    digits = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a number."}],
                                            max_tokens=8, temperature=0, extra_body={"guided_regex": r"[1-9]\d{2}"})
    assert re.fullmatch(r"[1-9]\d{2}", digits.choices[0].message.content)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for path, body in ((COMP, {"prompt": "JSON:"}), (CHAT, {"messages": ASK})):
        r = post(tool_server, path, {**body, "max_tokens": 20, "temperature": 0,
                                     "structured_outputs": {"json": schema}})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        jsonschema.validate(json.loads(c["text"] if path == COMP else c["message"]["content"]), schema)
    grammar = 'root ::= "north" | "south"'
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0, stream=True,
                                            extra_body={"structured_outputs": {"grammar": grammar}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("north", "south")


@pytest.mark.parametrize("extra,names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, ["response_format", "guided_regex"]),
    ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, ["guided_choice", "tool_choice"]),
])
def test_several_kinds_are_a_400_naming_them(tool_server, extra, names):
    r = post(tool_server, CHAT, {"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == names[1] and all(n in err["message"] for n in names)


@pytest.mark.parametrize("field,value", [
    ("guided_json", {"type": "object", "properties": {"a": {"type": "nonsense"}}}),
    ("guided_regex", "(unclosed"),
    ("guided_grammar", "root ::= missing_rule"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_constraint_is_a_400_before_anything_streams(tool_server, field, value, stream):
    r = post(tool_server, CHAT, {"messages": ASK, "max_tokens": 4, "stream": stream, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field) and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_that_cannot_constrain_is_a_400_naming_tools(tool_server, choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}}}]
    r = post(tool_server, CHAT, {"messages": ASK, "max_tokens": 4, "tools": tools, "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "uniqueItems" in err["message"]


def test_beam_search_with_a_constraint_is_refused(tool_server):
    r = post(tool_server, COMP, {"prompt": "Hi", "max_tokens": 4, "use_beam_search": True, "n": 2,
                                 "temperature": 0, "guided_choice": ["a", "b"]})
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


def test_a_broken_schema_does_not_touch_another_stream(client, tool_server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=48,
              temperature=0)
    alone = client.chat.completions.create(**kw).choices[0].message.content
    stream = iter(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    first = next(stream)  # streaming now
    bad = post(tool_server, CHAT, {"messages": ASK, "stream": True, "guided_regex": "[unclosed"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
    chunks = [first, *stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone and chunks[-1].usage.completion_tokens == 48


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("hold", [{"min_tokens": 6}, {"ignore_eos": True}])
def test_a_grammar_its_own_request_keeps_from_ending_is_a_400(tool_server, stream, hold):
    """The grammar is complete after "yes" and only its end may follow, which min_tokens (or
    ignore_eos) forbids: the request's own parameters contradict, a client error found
    mid-generation, not the server's."""
    body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "stream": stream, "guided_choice": ["yes"], **hold}
    r = post(tool_server, CHAT, body)
    if not stream:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
    else:  # the headers went out before the step found it: the error travels in the stream
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        err = events[-1]["error"]
        assert err["code"] == 400
    assert err["type"] == "invalid_request_error" and "structured outputs" in err["message"]
    ok = post(tool_server, CHAT, {**body, "stream": False, "min_tokens": 0, "ignore_eos": False})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "yes"
