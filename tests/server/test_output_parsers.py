"""The reasoning and tool-call parsers end to end on the default model, which writes a
family's format after a few examples of it: --reasoning-parser qwen3 (Qwen3's `<think>...
</think>`) gives reasoning_content apart from the answer, whole and streamed alike, and a
JSON schema constrains only what follows the thinking (the grammar starts after </think>, as
vLLM's); --tool-call-parser pythonic reads Llama 3.2's `[f(x=...)]` into tool_calls."""
from __future__ import annotations

import json

import pytest

from .conftest import MODEL
from .inproc import serve_in_process

SHOTS = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "<think>One plus one is two.</think>2"},
         {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "<think>Two plus three is five.</think>5"},
         {"role": "user", "content": "What is 3 + 3?"}, {"role": "assistant", "content": "<think>Three plus three is six.</think>6"},
         {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server():
    s = serve_in_process("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai(max_retries=0, timeout=120)


def test_reasoning_content_whole_and_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=40, temperature=0)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Two plus two is four." and msg.content == "4"
    chunks = list(client.chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=40, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert sum(1 for d in deltas if getattr(d, "reasoning_content", None)) > 1, "the reasoning streams in pieces"


def test_a_schema_constrains_only_the_answer(client):
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
    r = client.chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "sum", "schema": schema}})
    msg = r.choices[0].message
    assert msg.reasoning_content == "Two plus two is four.", "the thinking was constrained"
    assert isinstance(json.loads(msg.content)["sum"], int), msg.content


def test_pythonic_calls_are_tool_calls(client):
    shots = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": '[get_weather(city="Oslo")]'},
             {"role": "user", "content": "Weather in Rome?"},
             {"role": "assistant", "content": '[get_weather(city="Rome")]'},
             {"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model=MODEL, messages=shots, tools=tools, max_tokens=30, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content


def test_reasoning_in_the_responses_and_messages_apis(server, client):
    """A Responses reasoning item (streamed as reasoning_text events) and an Anthropic thinking
    block (streamed as thinking_delta) carry the same thinking as chat's reasoning_content."""
    r = client.responses.create(model=MODEL, input=SHOTS, max_output_tokens=40, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Two plus two is four." and r.output_text == "4"
    with client.responses.stream(model=MODEL, input=SHOTS, max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == "Two plus two is four." and events[-1].response.output_text == "4"
    anthropic = server.anthropic(max_retries=0)
    m = anthropic.messages.create(model=MODEL, max_tokens=40, messages=SHOTS, extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == "Two plus two is four."
    with anthropic.messages.stream(model=MODEL, max_tokens=40, messages=SHOTS, extra_body={"temperature": 0}) as st:
        final = st.get_final_message()
    assert final.content[0].thinking == "Two plus two is four." and final.content[1].text == "4"
