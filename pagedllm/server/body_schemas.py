"""The request bodies as /openapi.json declares them, where the routes' own models are looser.

The Messages and Responses routes validate their content blocks and input items by hand, to
refuse what this server does not run by name (an image block, a web-search tool) in the
caller's API's error shape; their pydantic models take those as plain objects. A client, and
the schema fuzzer (tests/server/test_fuzz_bodies.py), need the shapes themselves: each block and
item with its fields and their types, so that a tool_result whose content is null, or a refusal
that is a number, is a body the schema says is wrong and the fuzzer sends. The runtime adapter
endpoints read their two fields by hand too; their bodies are declared here."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .messages_request import MessagesRequest
from .responses_request import ResponsesRequest


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- Anthropic's Messages -----------------------------------------------------------------
class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class MessageTurn(_Block):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock]


class MessagesBody(MessagesRequest):
    messages: list[MessageTurn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None


class CountTokensBody(MessagesBody):
    max_tokens: int | None = None   # not a field of this request


# -- OpenAI's Responses ---------------------------------------------------------------------
class TextPart(_Block):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Block):
    type: Literal["refusal"]
    refusal: str


class InputMessage(_Block):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart | RefusalPart]


class FunctionCallItem(_Block):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Block):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(_Block):
    type: Literal["reasoning"]


class ResponsesBody(ResponsesRequest):
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]


# -- vLLM's runtime adapter endpoints ---------------------------------------------------------
class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
