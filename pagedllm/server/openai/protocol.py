"""OpenAI request shapes (pydantic), validated with field names and ranges in errors."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from .structured import FieldError, StructuredRequest
from .tools import ChatTool, NamedToolChoice, ToolChoice, tool_constraint, tool_mode


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(StructuredRequest):
    # Unknown fields are ignored, as OpenAI-compatible servers do; known ones are strict.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model, as vLLM
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's: with --scheduling-policy priority, lower runs first (then arrival); 0 otherwise.
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    # OpenAI's: token id (a string in JSON) -> bias, clamped to [-100, 100] as vLLM does.
    logit_bias: dict[int, float] | None = None
    best_of: int | None = Field(None, ge=1, le=16)   # draw this many, return the n of highest cumulative logprob
    # vLLM's beam search: n is the beam width; HF's length_penalty and early_stopping.
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        if any(t < 0 for t in v) or any(b != b or abs(b) == float("inf") for b in v.values()):
            raise ValueError("logit_bias must map token ids >= 0 to finite numbers")
        return {t: max(-100.0, min(100.0, b)) for t, b in v.items()}

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return v

    # vLLM's: each prompt token's logprob and top k (the limit is the engine's --max-logprobs).
    prompt_logprobs: int | None = Field(None, ge=0)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams | BeamSearchParams:
        constraint = self.constraint()
        if self.use_beam_search:
            if constraint is not None:
                raise FieldError(constraint[0], "structured outputs are not supported with use_beam_search")
            return self._beam_params(max_tokens, logprobs, prompt_logprobs)
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: the best samples are known only at the end, so best_of > n cannot stream")
        return SamplingParams(n=self.n, best_of=self.best_of, temperature=self.temperature, top_p=self.top_p,
                              top_k=0 if self.top_k == -1 else self.top_k, seed=self.seed,
                              max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                              ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                              min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                              logit_bias=self.logit_bias, structured_outputs=constraint[1] if constraint else None)

    def _beam_params(self, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None) -> BeamSearchParams:
        """Settings that sampling reads but beams do not are refused, never ignored."""
        if "temperature" in self.model_fields_set and self.temperature != 0:
            raise ValueError("use_beam_search: beam search here is deterministic, temperature must be 0")
        if logprobs is not None or prompt_logprobs is not None:
            raise ValueError("use_beam_search: logprobs are not returned for beams")
        for name in ("stop", "stop_token_ids", "logit_bias", "best_of", "seed"):
            if getattr(self, name):
                raise ValueError(f"use_beam_search: {name} is not applied to beams")
        for name in ("presence_penalty", "frequency_penalty", "min_p", "min_tokens", "repetition_penalty",
                     "top_p", "top_k"):
            if name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"use_beam_search: {name} is not applied to beams")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                length_penalty=self.length_penalty, early_stopping=self.early_stopping)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: the prompt alone, scored (OpenAI's, for log-likelihoods); run as 1 token, dropped.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and len(v) > 64 and isinstance(v[0], (str, list)):
            raise ValueError("at most 64 prompts per request")
        return v

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0 with echo: each choice is its prompt alone."""
        return self.echo and self.max_tokens == 0

    def engine_prompt_logprobs(self) -> int | None:
        """The top k of prompt logprobs to compute: enough for vLLM's field and for the echoed
        prompt's logprobs, each of which keeps its own k of them."""
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(ks) if ks else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class MessageFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: MessageFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                   # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's): a developer is a system message,
        content is text (empty when null), and earlier calls' arguments are objects."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str) -> Any:
    """A call's arguments as an object for the template, or its text when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def conversation(messages: list[ChatMessage]) -> list[dict]:
    try:
        return [m.for_template() for m in messages]
    except ValueError as e:
        raise FieldError("messages", str(e)) from None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None   # None: true, as OpenAI's default
    chat_template_kwargs: dict[str, Any] | None = None

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (FieldError for a choice without its tools)."""
        return tool_mode(self.tools, self.tool_choice)

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """A forced tool call is a constraint too: one more kind that excludes the others."""
        found = super().constraints()
        mode = self.tool_mode()
        if mode in ("required", "named") and self.tools:
            params = tool_constraint(self.tools, mode, self.named_tool, self.parallel_tool_calls is not False)
            found.append(("tool_choice", params))
        return found
