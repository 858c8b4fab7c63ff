"""The request side of structured outputs and tools, without a server: what each field maps
to in SamplingParams, what is refused and by which name, the forced-call schemas, and what
the chat template is given."""
from __future__ import annotations

import copy

import jsonschema
import pydantic
import pytest

from pagedllm.sampling_params import BeamSearchParams, StructuredOutputsParams
from pagedllm.server.openai.chat_template import render_chat
from pagedllm.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.openai.structured import FieldError
from pagedllm.server.openai.tools import ChatTool, required_schema, tool_dicts

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object


def chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": MSGS, **fields})


def constraint(req) -> StructuredOutputsParams | None:
    return req.sampling_params(8, None).structured_outputs


@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
     StructuredOutputsParams(regex="[a-z]+", disable_any_whitespace=True)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": r"\d+", "guided_decoding_backend": "auto"}, StructuredOutputsParams(regex=r"\d+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_fields_map_to_structured_outputs(fields, expected):
    assert constraint(chat(**fields)) == expected
    assert constraint(CompletionRequest.model_validate({"prompt": "x", **fields})) == expected


@pytest.mark.parametrize("fields,names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, ("response_format", "guided_regex")),
    ({"structured_outputs": {"choice": ["a"]}, "guided_json": SCHEMA}, ("structured_outputs", "guided_json")),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     ("response_format", "tool_choice")),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "guided_choice": ["a"]}, ("guided_choice", "tool_choice")),
])
def test_several_kinds_are_refused_by_name(fields, names):
    with pytest.raises(FieldError) as e:
        chat(**fields).sampling_params(8, None)
    assert e.value.param == names[1] and all(n in str(e.value) for n in names)


def test_auto_tool_choice_is_no_constraint():
    req = chat(tools=[WEATHER], guided_regex="<tool_call>.*</tool_call>")
    assert req.tool_mode() == "auto" and constraint(req) == StructuredOutputsParams(regex="<tool_call>.*</tool_call>")


@pytest.mark.parametrize("fields,param", [
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": r"[ ]?"}, "guided_whitespace_pattern"),
])
def test_bad_shapes_name_their_field(fields, param):
    with pytest.raises(FieldError) as e:
        chat(**fields).sampling_params(8, None)
    assert e.value.param == param and str(e.value).startswith(param)


def test_unknown_structured_outputs_key_and_schema_without_schema_are_refused():
    with pytest.raises(pydantic.ValidationError, match="structural_tag"):
        chat(structured_outputs={"structural_tag": "{}"})
    with pytest.raises(pydantic.ValidationError, match="json_schema"):
        chat(response_format={"type": "json_schema"})


def test_beam_search_with_a_constraint_is_not_supported():
    with pytest.raises(FieldError, match="not supported with use_beam_search") as e:
        chat(use_beam_search=True, n=2, temperature=0, guided_choice=["a", "b"]).sampling_params(8, None)
    assert e.value.param == "guided_choice"
    with pytest.raises(FieldError, match="tool_choice"):
        chat(use_beam_search=True, temperature=0, tools=[WEATHER], tool_choice="required").sampling_params(8, None)
    assert isinstance(chat(use_beam_search=True, temperature=0).sampling_params(8, None), BeamSearchParams)


@pytest.mark.parametrize("fields,param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_tool_choice_needs_its_tools(fields, param):
    with pytest.raises(FieldError) as e:
        chat(**fields).tool_mode()
    assert e.value.param == param


def test_tool_modes():
    assert chat().tool_mode() == "none"
    assert chat(tools=[WEATHER]).tool_mode() == "auto"  # vLLM's default with tools
    assert chat(tools=[WEATHER], tool_choice="none").tool_mode() == "none"
    assert chat(tool_choice="none").tool_mode() == "none"
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_mode() == "named" and constraint(named) == StructuredOutputsParams(json=SCHEMA)


def test_required_schema_accepts_calls_and_nothing_else():
    req = chat(tools=[WEATHER, TIME], tool_choice="required")
    schema = constraint(req).json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}},
                         {"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "get_time"}], {"name": "get_time", "parameters": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = constraint(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)).json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)


def test_required_schema_hoists_defs():
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}
    tools = [ChatTool.model_validate({"function": {"name": "go", "parameters": params}})]
    schema = required_schema(tools)
    assert schema["$defs"] == {"Point": point} and tools[0].function.parameters == params  # request untouched
    jsonschema.validate([{"name": "go", "parameters": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": {"y": 1}}}], schema)
    other = copy.deepcopy(params)
    other["$defs"]["Point"] = {"type": "string"}
    clash = tools + [ChatTool.model_validate({"function": {"name": "stay", "parameters": other}})]
    with pytest.raises(FieldError, match=r"\$defs.Point"):
        required_schema(clash)


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    tok = copy.copy(load_tokenizer(resolve_model_dir(None)))
    # A template that shows what it is given: tools, a kwarg, earlier calls and tool answers.
    tok.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% if style %}[style {{ style }}]{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} x={{ c.function.arguments.x }}]"
        "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}")
    return tok


def test_template_gets_tools_kwargs_and_tool_messages(tokenizer):
    req = chat(messages=MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"x": 3}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}],
        tools=[WEATHER, TIME], chat_template_kwargs={"style": "terse"})
    text = render_chat(tokenizer, req.conversation(), False, tool_dicts(req.tools), req.chat_template_kwargs)
    assert text == ("[tool get_weather][tool get_time][style terse]<user>hi"
                    "<assistant>[call call-1 get_weather x=3]<tool>sunny[for call-1]")


def test_template_kwargs_may_not_set_the_call(tokenizer):
    with pytest.raises(FieldError, match="tokenize") as e:
        render_chat(tokenizer, MSGS, True, None, {"tokenize": True, "style": "x"})
    assert e.value.param == "chat_template_kwargs"
