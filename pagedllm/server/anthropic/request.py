"""Anthropic's Messages API on the request side: its shapes and the chat request each one
becomes, as responses/request.py does for OpenAI's Responses. Content blocks: text,
tool_use (an assistant's earlier call) and tool_result (its answer, in the next user
turn); images, documents, thinking and server tools are refused by name. Structured
outputs come as `output_config.format` (a JSON schema), as the client's messages.parse
sends them."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..openai.structured import FieldError
from ..openai.tools import validated_tools


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    # "schema" would shadow BaseModel.schema(), hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: OutputFormat | None = None
    effort: None = None   # how long to think: this server's models do not think on a budget


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # vLLM's extras, as on chat
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    priority: int = 0

    def custom_tools(self) -> list[AnthropicTool] | None:
        if self.tools is None:
            return None
        return validated_tools(self.tools, AnthropicTool, _server_tool)



def _server_tool(tool: dict[str, Any]) -> str | None:
    if tool.get("type") in (None, "custom"):
        return None
    return f"{tool['type']!r} is a server tool of Anthropic's; only custom tools (name, description, " \
           "input_schema) run here"


# field -> "is this value a no-op?": the rest asks for what this server does not do.
REFUSED = {
    "thinking": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "disabled"),
    "container": lambda v: v is None,
    "mcp_servers": lambda v: not v,
    "context_management": lambda v: v is None,
}



def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "".join(_text_block(b, f"system.{j}") for j, b in enumerate(system))


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else None
        raise FieldError(where, f"{kind!r} blocks are not supported here; only text")
    return block["text"]


def chat_messages(messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The turns as chat messages: a user turn's tool_result blocks become tool messages (before
    its text), an assistant turn's tool_use blocks its tool_calls."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue   # an earlier turn's thinking: chat templates drop it too
            if kind == "tool_use" and m.role == "assistant":
                calls.append(_call(block, where))
            elif kind == "tool_result" and m.role == "user":
                out.append(_result(block, where))
            else:
                texts.append(_text_block(block, where))
        if texts or not calls:
            out.append({"role": m.role, "content": "".join(texts)})
        if calls:
            if out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
                out[-1]["tool_calls"] = calls
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": calls})
    return out


def _call(block: dict, where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input"), dict):
        raise FieldError(where, "a tool_use block needs an id, a name and an input object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _result(block: dict, where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise FieldError(where, "a tool_result block needs the tool_use_id it answers")
    content = block.get("content", "")
    if not isinstance(content, (str, list)):
        raise FieldError(f"{where}.content", "a tool_result's content must be a string or a list of text blocks")
    text = content if isinstance(content, str) else "".join(
        _text_block(b, f"{where}.content.{k}") for k, b in enumerate(content))
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def chat_body(req: MessagesRequest, tools: list[AnthropicTool] | None) -> dict:
    system = system_text(req.system)
    messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(req.messages)
    body: dict[str, Any] = {"messages": messages, "max_completion_tokens": req.max_tokens, "stream": req.stream}
    for src, dst in (("model", "model"), ("stop_sequences", "stop"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("top_k", "top_k"), ("cache_salt", "cache_salt"), ("priority", "priority")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise FieldError("tool_choice.name", 'type "tool" needs the name of the tool')
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.json_schema}}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


# A chat field's error, named as the Messages request names it.
CHAT_TO_MESSAGES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages",
                    "response_format": "output_config.format"}
