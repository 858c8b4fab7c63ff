"""Chat tools (OpenAI function tools) on the request side: their shapes, what `tool_choice`
asks for, and the JSON schema that constrains a forced call (vLLM's):

- "none": plain text (the template still sees the tools, as vLLM's does by default);
- "auto" (the default with tools): free text, read for calls by the server's
  --tool-call-parser; only with --enable-auto-tool-choice;
- "required": a JSON array of one or more {"name", "parameters"} objects, each a tool's;
- {"type": "function", "function": {"name": ...}}: that tool's parameters object, one call.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ...sampling_params import StructuredOutputsParams
from .structured import FieldError

M = TypeVar("M", bound=BaseModel)

# A tool without parameters takes an empty object (OpenAI's reading of a missing schema).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_dicts(tools: list[ChatTool] | None) -> list[dict] | None:
    """The tools as a chat template reads them (OpenAI's shape)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def tool_mode(tools: list[ChatTool] | None, choice: ToolChoice | None) -> str:
    """"none", "auto", "required" or "named"; FieldError for a choice the tools cannot meet."""
    if tools is not None and not tools:
        raise FieldError("tools", "must not be empty; leave it out for no tools")
    if choice is None:
        return "auto" if tools else "none"
    if choice == "none":
        return "none"
    if not tools:
        raise FieldError("tool_choice", "needs tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise FieldError("tool_choice", f"names the function {choice.function.name!r}, which is not in tools")
        return "named"
    return choice


def tool_constraint(tools: list[ChatTool], mode: str, named: str | None, parallel: bool) -> StructuredOutputsParams:
    """The schema a forced call ("required" or "named") must match."""
    if mode == "named":
        tool = next(t for t in tools if t.function.name == named)
        return StructuredOutputsParams(json=tool.function.parameters or NO_PARAMETERS)
    return StructuredOutputsParams(json=required_schema(tools, parallel))


def required_schema(tools: list[ChatTool], parallel: bool = True) -> dict[str, Any]:
    """An array of calls, each {"name": one tool's name, "parameters": its schema}. Each
    tool's $defs move to the top, where its "#/$defs/..." references now point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters or NO_PARAMETERS)
        own = params.pop("$defs", {})
        if not isinstance(own, dict):
            raise FieldError("tools", f"{tool.function.name}: parameters.$defs must be an object")
        for name, schema in own.items():
            if defs.setdefault(name, schema) != schema:
                raise FieldError("tools", f"two tools define $defs.{name} differently; a forced call "
                                          "needs one definition per name")
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def validated_tools(tools: list[dict[str, Any]], model: type[M], refusal: Callable[[dict[str, Any]], str | None]
                    ) -> list[M]:
    """Another API's tools (Responses', Messages'), each read as `model`: a FieldError names the
    first one refused by kind (refusal(tool) says why; None runs it) or whose fields are wrong."""
    out = []
    for i, tool in enumerate(tools):
        why = refusal(tool)
        if why is not None:
            raise FieldError(f"tools.{i}.type", why)
        try:
            out.append(model.model_validate(tool))
        except ValueError as e:
            raise FieldError(f"tools.{i}", str(e).splitlines()[-1].strip()) from None
    return out
