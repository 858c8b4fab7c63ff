"""The Responses request body as /openapi.json declares it, where the route's own model is
looser.

The route validates input items by hand, to refuse what this server does not run by name (an
image part, a hosted tool) in OpenAI's error shape; ResponsesRequest takes items as plain
objects. A client, and the schema fuzzer (tests/server/test_fuzz_bodies.py), need the shapes
themselves: each item with its fields and their types, so that a refusal that is a number is
a body the schema says is wrong and the fuzzer sends."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .request import ResponsesRequest


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Item):
    type: Literal["refusal"]
    refusal: str


class InputMessage(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart | RefusalPart]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(_Item):
    type: Literal["reasoning"]


class ResponsesBody(ResponsesRequest):
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
