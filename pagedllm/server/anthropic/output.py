"""Anthropic's Messages API on the response side: a chat answer made into a Message, whole or
as Anthropic's stream (message_start, content_block_start/delta/stop, message_delta,
message_stop, each an SSE event of that name), and errors in Anthropic's shape."""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from ..translation import ChatEnd, chat_deltas

# An HTTP status as Anthropic's error types name it.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def stop_reason(finish: str | None, matched: Any) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) from chat's finish_reason and the stop string it matched."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_usage: dict | None, input_tokens: int) -> dict:
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # Anthropic's input_tokens are those not read from the cache; the cached ones are apart.
    return {"input_tokens": u.get("prompt_tokens", input_tokens) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class MessageShape:
    def __init__(self, mid: str, model: str, input_tokens: int) -> None:
        self.id, self.model, self.input_tokens = mid, model, input_tokens

    def obj(self, content: list[dict], reason: str | None, sequence: str | None, chat_usage: dict | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat_usage, self.input_tokens)}

    def whole(self, chat: dict) -> dict:
        choice = chat["choices"][0]
        msg = choice["message"]
        content = [{"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""}] \
            if msg.get("reasoning_content") else []
        content += [{"type": "text", "text": msg["content"]}] if msg.get("content") else []
        content += [tool_use(c) for c in msg.get("tool_calls") or []]
        return self.obj(content, *stop_reason(choice["finish_reason"], choice.get("stop_reason")), chat["usage"])


def sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageEvents:
    """Anthropic's stream from the chat stream's chunk dicts: a text block opens with the first
    text, a tool_use block with each call (its input streamed as partial JSON)."""

    def __init__(self, shape: MessageShape) -> None:
        self.shape = shape
        self.index = -1            # the open block's index
        self.open: str | None = None  # its type

    def start(self) -> list[str]:
        return [sse("message_start", {"message": self.shape.obj([], None, None, None)}), sse("ping", {})]

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        end = ChatEnd()
        async for delta in chat_deltas(chunks, end):
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    yield from_list(self._open({"type": "thinking", "thinking": "", "signature": ""}))
                yield sse("content_block_delta", {"index": self.index, "delta": {
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]}})
            if delta.get("content"):
                if self.open != "text":
                    yield from_list(self._open({"type": "text", "text": ""}))
                yield sse("content_block_delta", {"index": self.index,
                                                  "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if "id" in call:
                    yield from_list(self._open({"type": "tool_use", "id": call["id"], "name": fn.get("name", ""),
                                                "input": {}}))
                if fn.get("arguments"):
                    yield sse("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}})
        for e in self._close():
            yield e
        reason, sequence = stop_reason(end.finish_reason, end.stop_reason)
        u = usage(end.usage, self.shape.input_tokens)
        yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": u})
        yield sse("message_stop", {})

    def failed(self, status: int, message: str) -> str:
        return sse("error", {"error": error_body(status, message)["error"]})

    def _open(self, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [sse("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"index": self.index})]


def from_list(events: list[str]) -> str:
    return "".join(events)
