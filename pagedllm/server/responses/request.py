"""OpenAI's Responses API on the request side: its shapes (pydantic, errors naming the field)
and the chat request each one becomes. The server runs a Responses request as a chat
completion (the same template, tools, structured outputs, tenants and limits), so the two
APIs cannot drift apart; output.py turns the chat answer back.

What the API has and this server does not do (hosted tools, images and files, background
runs, reasoning settings) is refused with a 400 naming the field, never ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..openai.structured import FieldError
from ..openai.tools import FunctionDefinition, validated_tools


class FunctionTool(FunctionDefinition):
    """A function tool as Responses writes it: chat's function definition, flat (not under
    "function") with its type beside it."""
    type: Literal["function"]


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # "schema" would shadow BaseModel.schema(), hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do; those this server knows
    # and cannot honour are in REFUSED.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None   # OpenAI's bounds: 16 keys of <= 64 characters, values <= 512
    user: str | None = None
    # vLLM's extras, as on chat
    seed: int | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    priority: int = 0

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            if len(v) > 16:
                raise ValueError(f"at most 16 keys, got {len(v)}")
            long_key = next((k for k in v if len(k) > 64), None)
            if long_key is not None:
                raise ValueError(f"keys are at most 64 characters, {long_key[:20]!r}... has {len(long_key)}")
            long_value = next((k for k, x in v.items() if len(x) > 512), None)
            if long_value is not None:
                raise ValueError(f"values are at most 512 characters, {long_value!r}'s has {len(v[long_value])}")
        return v

    def function_tools(self) -> list[FunctionTool] | None:
        if self.tools is None:
            return None
        return validated_tools(self.tools, FunctionTool, _hosted_tool)


def _hosted_tool(tool: dict[str, Any]) -> str | None:
    kind = tool.get("type")
    if kind == "function":
        return None
    return f"{kind!r} tools are not supported here; only function tools (hosted tools such as web_search or " \
           "file_search are OpenAI's)"


def _no_op(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {}


# field -> "is this value a no-op?": the rest asks for what this server does not do.
REFUSED = {
    "background": _no_op,
    "conversation": _no_op,
    "prompt": _no_op,
    "reasoning": lambda v: _no_op(v) or (isinstance(v, dict) and all(x is None for x in v.values())),
    "include": _no_op,
    "max_tool_calls": _no_op,
    "top_logprobs": lambda v: v is None or v == 0,
}
TRUNCATION = ('truncation: "auto" would drop input to fit the context; this server refuses a prompt that does not '
              'fit instead')


# -- input items -> chat messages ------------------------------------------------------
def input_messages(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages (OpenAI's chat shape). Function calls in a row
    become one assistant message's tool_calls; their outputs become tool messages."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not input_:
        raise FieldError("input", "must not be empty")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        if not isinstance(item, dict):
            raise FieldError(f"input.{i}", "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", i), "type": "function",
                    "function": {"name": _text_field(item, "name", i), "arguments": _text_field(item, "arguments", i)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None \
                    and not last["content"]:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "reasoning":
            continue   # an earlier response's thinking, sent back: chat templates drop it too
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", i),
                        "content": output if isinstance(output, str) else _parts_text(output, f"input.{i}.output")})
        else:
            raise FieldError(f"input.{i}.type", f"{kind!r} items are not supported here; supported: message, "
                                                 "function_call, function_call_output, reasoning")
    return out


ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def _message(item: dict, i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise FieldError(f"input.{i}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"input.{i}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise FieldError(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            if not isinstance(part.get("refusal", ""), str):
                raise FieldError(f"{where}.{j}.refusal", "must be a string")
            texts.append(part.get("refusal") or "")
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise FieldError(f"{where}.{j}", f"{kind!r} content is not supported here; only text "
                                             "(input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)


def _text_field(item: dict, name: str, i: int) -> str:
    v = item.get(name)
    if not isinstance(v, str) or not v and name != "arguments":
        raise FieldError(f"input.{i}.{name}", "must be a non-empty string")
    return v


# -- the chat request -------------------------------------------------------------------
def chat_body(req: ResponsesRequest, convo: list[dict[str, Any]], tools: list[FunctionTool] | None) -> dict:
    """The chat completion request that answers `req`, whose conversation so far is `convo`
    (a stored one it continues, then its input). Instructions lead, and are not carried over
    from an earlier response, as OpenAI's are not."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + convo
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    for src, dst in (("model", "model"), ("max_output_tokens", "max_completion_tokens"),
                     ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("cache_salt", "cache_salt"),
                     ("priority", "priority"), ("user", "user")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        body["tool_choice"] = c if isinstance(c, str) else {"type": "function", "function": {"name": c.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.json_schema is None or not fmt.name:
            raise FieldError("text.format", 'type "json_schema" needs a name and a schema')
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


# A chat field's error, named as the Responses request names it.
CHAT_TO_RESPONSES = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                     "response_format": "text.format"}
