"""OpenAI's Responses API (/v1/responses) driven by the official openai client
(responses.create, .stream, .parse) and by the openai-agents SDK, on the default model under
greedy decoding: the same answers as chat, tools forced by their schema, conversations
continued from stored responses per tenant, and what is not served refused by name."""
from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from .conftest import MODEL

ASK = "What is the weather like in Paris?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(tool_server):
    return tool_server.openai(api_key="unused", max_retries=0, timeout=120)


def test_text_input_answers_as_chat_does(client):
    r = client.responses.create(model=MODEL, input=ASK, instructions="Answer briefly.", max_output_tokens=12,
                                temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}])
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12


def test_stream_gives_the_same_text_and_events_in_order(client):
    whole = client.responses.create(model=MODEL, input=ASK, max_output_tokens=16, temperature=0)
    with client.responses.stream(model=MODEL, input=ASK, max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
    final = events[-1].response   # cut short: response.incomplete ends it, as OpenAI's
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == 16


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    degrees: int
    sunny: bool


def test_parse_a_pydantic_model(client):
    r = client.responses.parse(model=MODEL, input=ASK, text_format=Forecast, max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, Forecast), r.output_text
    assert Forecast.model_validate_json(r.output_text) == r.output_parsed


def test_forced_tool_call_then_its_output_continues_the_stored_conversation(client):
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo", "Rome")
    again = client.responses.retrieve(first.id)
    assert again.output[0].call_id == calls[0].call_id
    # The tool's output, on the stored conversation: the template sees the call and its result.
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=12, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "18 degrees and sunny"}])
    whole = client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=12,
                                    temperature=0, input=[
                                        {"role": "user", "content": ASK},
                                        {"type": "function_call", "call_id": calls[0].call_id,
                                         "name": calls[0].name, "arguments": calls[0].arguments},
                                        {"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "18 degrees and sunny"}])
    assert second.output_text and second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0, "the stored conversation's blocks are reused"


def test_streamed_tool_call_events(client):
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=60, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.name == "get_weather" and done.arguments == call.arguments
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")


def test_stored_responses_belong_to_their_tenant(keyed_server):
    alice = keyed_server.openai(api_key="alice-key", max_retries=0)
    bob = keyed_server.openai(api_key="bob-key", max_retries=0)
    name = keyed_server.built.state.model_name
    r = alice.responses.create(model=name, input="Hi", max_output_tokens=2, temperature=0)
    assert alice.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        bob.responses.create(model=name, input="Go on", previous_response_id=r.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    unkept = alice.responses.create(model=name, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError, match="store: false"):
        alice.responses.create(model=name, input="Go on", previous_response_id=unkept.id, max_output_tokens=2)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
])
def test_what_is_not_served_is_refused_by_name(tool_server, body, param):
    r = tool_server.client().post("/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_a_two_turn_tool_run_of_the_openai_agents_sdk(tool_server):
    """The SDK's default model speaks Responses: turn one must call the tool (tool_choice
    "required"), the SDK runs it and sends its output back; turn two, its tool choice reset to
    auto (read by the server's hermes parser), answers in text."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)   # the SDK's traces would go to OpenAI
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"18 degrees and sunny in {city}"

    model = OpenAIResponsesModel(model=MODEL, openai_client=tool_server.async_openai(max_retries=0))
    agent = Agent(name="forecaster", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    result = Runner.run_sync(agent, ASK, max_turns=3)
    assert asked and asked[0] in ("Paris", "Oslo", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2


def test_metadata_is_bounded_and_a_refused_store_says_so(keyed_server):
    """metadata within OpenAI's bounds (16 keys, 64-character keys, 512-character values), else a
    400 naming them; a record over what the tenant's store may hold is not kept, and the response
    (whole or the stream's final event) says store: false."""
    from pagedllm.server.responses.store import ResponseStore

    alice = keyed_server.openai(api_key="alice-key", max_retries=0)
    name = keyed_server.built.state.model_name
    for meta, says in (({f"k{i}": "v" for i in range(17)}, "16 keys"), ({"k" * 65: "v"}, "64 characters"),
                       ({"k": "v" * 513}, "512 characters")):
        with pytest.raises(openai.BadRequestError, match=says):
            alice.responses.create(model=name, input="Hi", max_output_tokens=1, metadata=meta)
    state = keyed_server.built.state
    saved, state.responses = state.responses, ResponseStore(8, bytes_per_tenant=6_000, bytes_total=40_000)
    try:
        http = keyed_server.client(headers={"Authorization": "Bearer alice-key"})
        big = {f"key{i}": "v" * 500 for i in range(16)}   # 8 KB of metadata: counted with the rest
        body = {"model": name, "input": "Hi", "max_output_tokens": 1, "metadata": big}
        whole = http.post("/v1/responses", json=body, timeout=120).json()
        assert whole["store"] is False and http.get(f"/v1/responses/{whole['id']}").status_code == 404
        stream = http.post("/v1/responses", json={**body, "stream": True}, timeout=120).text
        final = json.loads([ln for ln in stream.splitlines() if ln.startswith("data:")][-1][5:])
        assert final["type"] in ("response.completed", "response.incomplete") and final["response"]["store"] is False
        kept = http.post("/v1/responses", json={**body, "metadata": {"k": "v"}}, timeout=120).json()
        assert kept["store"] is True and http.get(f"/v1/responses/{kept['id']}").status_code == 200
        assert 0 < state.responses.bytes_held(state.tenant("alice-key")) <= 6_000
    finally:
        state.responses = saved
