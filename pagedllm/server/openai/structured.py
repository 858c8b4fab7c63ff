"""The request fields that constrain an output (structured outputs), mapped to the engine's
StructuredOutputsParams: OpenAI's `response_format`, vLLM's `structured_outputs` object and
its older `guided_*` fields. A request asks for one constraint at most: two (a schema and a
regex, say) would have to be intersected, which no backend does, so they are refused by name.
Whether the schema, regex or grammar itself compiles is the engine's to say (check_structured).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...sampling_params import StructuredOutputsParams

# Values of guided_decoding_backend that name what we run (xgrammar); vLLM's others
# (outlines, guidance, lm-format-enforcer) would be a promise we cannot keep.
BACKENDS = ("auto", "xgrammar")


class FieldError(ValueError):
    """A bad request field: the message starts with its name, `param` is the name alone."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}")
        self.param = param


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    # "schema" would shadow BaseModel.schema(), hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always matches the schema here, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's response_format; text asks for nothing."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object ({"name": ..., "schema": {...}})')
        return self

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            assert self.json_schema is not None
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class StructuredOutputsField(BaseModel):
    """vLLM's structured_outputs object. Unknown keys are refused, not dropped: a constraint
    we would silently leave out (structural_tag, whitespace_pattern) misleads the client."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # "json" would shadow BaseModel.json(), hence the alias.
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StructuredRequest(BaseModel):
    """The constraint fields shared by completions and chat."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """(request field, its constraint) for every field that asks for one."""
        self._check_guided_options()
        found = []
        for name, build in (("response_format", self._from_response_format),
                            ("structured_outputs", self._from_structured_outputs),
                            ("guided_json", lambda: self._guided(json=self.guided_json)),
                            ("guided_regex", lambda: self._guided(regex=self.guided_regex)),
                            ("guided_choice", lambda: self._guided(choice=self.guided_choice)),
                            ("guided_grammar", lambda: self._guided(grammar=self.guided_grammar))):
            try:
                params = build()
            except ValueError as e:  # StructuredOutputsParams' shape check
                raise FieldError(name, str(e)) from None
            if params is not None:
                found.append((name, params))
        return found

    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The one constraint this request asks for and the field it comes from (to name
        it in a compile error), or None; FieldError for several."""
        found = self.constraints()
        if len(found) > 1:
            names = [name for name, _ in found]
            raise FieldError(names[1], f"one constraint per request, got {' and '.join(names)}; "
                                       "keep one of them")
        return found[0] if found else None

    def _from_response_format(self) -> StructuredOutputsParams | None:
        return self.response_format.params() if self.response_format is not None else None

    def _from_structured_outputs(self) -> StructuredOutputsParams | None:
        so = self.structured_outputs
        return StructuredOutputsParams(**so.model_dump(by_alias=True)) if so is not None else None

    def _guided(self, **kind: Any) -> StructuredOutputsParams | None:
        if all(v is None for v in kind.values()):
            return None
        return StructuredOutputsParams(**kind)

    def _check_guided_options(self) -> None:
        if self.guided_whitespace_pattern is not None:
            raise FieldError("guided_whitespace_pattern", "not supported: xgrammar's JSON whitespace is fixed; "
                                                          "structured_outputs.disable_any_whitespace turns it off")
        backend = self.guided_decoding_backend
        if backend is not None and backend not in BACKENDS:
            raise FieldError("guided_decoding_backend",
                             f"this server runs xgrammar; allowed: {', '.join(BACKENDS)}, got {backend!r}")
