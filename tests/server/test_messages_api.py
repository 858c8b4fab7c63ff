"""Anthropic's Messages API (/v1/messages) driven by the PyPI anthropic client (messages.create,
.stream, count_tokens), on the default model under greedy decoding: the same answers as chat,
tool_use and tool_result blocks, stop sequences, Anthropic's usage, event names and errors."""
from __future__ import annotations

from typing import Literal

import anthropic
import pytest
from pydantic import BaseModel

from .conftest import MODEL

ASK = "What is the weather like in Paris?"
GREEDY = {"temperature": 0}   # the client no longer has sampling settings; the API still takes them
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}


@pytest.fixture(scope="module")
def client(tool_server):
    return tool_server.anthropic(api_key="unused", max_retries=0)


def test_system_and_turns_answer_as_chat_does(client, tool_server):
    m = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Answer briefly.",
                               messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                         {"role": "user", "content": ASK}])
    chat = tool_server.openai(max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=12, extra_body=GREEDY, messages=[
            {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": ASK}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=MODEL, system="Answer briefly.",
                                           messages=[{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": "Hello!"},
                                                     {"role": "user", "content": ASK}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_stream_text_equals_whole_and_a_stop_sequence_is_named(client):
    kw = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": ASK}])
    whole = client.messages.create(**kw)
    text = whole.content[0].text
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text and final.usage.output_tokens == 24
    stop = text.split()[2]
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text) and stop not in cut.content[0].text


def test_tool_use_then_tool_result(client):
    first = client.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "any"}, messages=[{"role": "user", "content": ASK}])
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert uses[0].input["city"] in ("Paris", "Oslo", "Rome") and uses[0].id
    second = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "18 degrees and sunny"}]}], tool_choice={"type": "none"})
    assert second.content[0].type == "text" and second.content[0].text
    assert second.usage.cache_read_input_tokens > 0, "the first turn's blocks are reused"


def test_streamed_tool_use(client):
    with client.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": ASK}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "input_json" in events
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city", "unit"}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    degrees: int


def test_parse_a_pydantic_model(client):
    m = client.messages.parse(model=MODEL, max_tokens=60, extra_body=GREEDY, output_format=Forecast,
                              messages=[{"role": "user", "content": ASK}])
    assert isinstance(m.parsed_output, Forecast), m.content


def test_keys_come_as_x_api_key(keyed_server):
    name = keyed_server.built.state.model_name
    ok = keyed_server.anthropic(api_key="alice-key", max_retries=0)
    assert ok.messages.create(model=name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content
    bad = keyed_server.anthropic(api_key="mallory", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled",
                                                                                      "budget_tokens": 1024}},
     "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "high"}},
     "output_config.effort"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "output_config.format"),
])
def test_bad_requests_get_anthropics_error_naming_the_field(tool_server, body, where):
    r = tool_server.client().post("/v1/messages", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(where), err
