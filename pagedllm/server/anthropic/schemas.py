"""The Messages request bodies as /openapi.json declares them, where the route's own model is
looser.

The route validates content blocks by hand, to refuse what this server does not run by name
(an image block, a server tool) in Anthropic's error shape; MessagesRequest takes blocks as
plain objects. A client, and the schema fuzzer (tests/server/test_fuzz_bodies.py), need the
shapes themselves: each block with its fields and their types, so that a tool_result whose
content is null is a body the schema says is wrong and the fuzzer sends."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .request import MessagesRequest


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")


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
