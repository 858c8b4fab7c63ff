"""Request fields this server does not implement: a 400 naming the field, never silence.

A client that asks for logits processors, legacy functions or a suffix and gets plain
text back has been misled, so those are refused. Fields that only describe the caller or
the transport (`user`, `metadata`, `store`, `service_tier`, `stream_options`) are still
ignored, as OpenAI-compatible servers do. A refused field at its no-op value (null,
`function_call: "none"`, `modalities: ["text"]`) asks for nothing, and passes. Structured
outputs and tools are served (pagedllm/server/openai/structured.py, tools.py).
"""
from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel


def _unset(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def _none_choice(v: Any) -> bool:
    return v is None or v == "none"


# field -> "is this value a no-op?"; what each refers to is in the error message.
COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {"logits_processors": _empty, "suffix": _empty}

CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logits_processors": _empty,
    "functions": _empty, "function_call": _none_choice,
    "audio": _unset, "modalities": lambda v: v is None or v == ["text"],
    "prediction": _unset, "web_search_options": _unset,
    "echo": _false, "continue_final_message": _false,
    "chat_template": _unset,
}


def unsupported_field(model: type[BaseModel], body: dict, refused: dict[str, Callable[[Any], bool]]) -> str | None:
    """The first field of `body` that asks for something this server does not do.
    A field the request model declares is implemented, whatever the list says."""
    for name, is_noop in refused.items():
        if name in body and name not in model.model_fields and not is_noop(body[name]):
            return name
    return None
