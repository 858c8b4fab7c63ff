"""OpenAI's Responses API on the response side: a chat answer made into a Response object,
whole or as the Responses stream's typed events (response.created ... response.completed),
each with its sequence number, from the chat stream's chunks.

Output items: the answer's text is one message item with one output_text part; each tool
call is a function_call item after it. A cut-short answer (max_output_tokens) is status
"incomplete" with its reason, as OpenAI's.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ..translation import ChatEnd, chat_deltas
from .request import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _status(finish: str | None) -> tuple[str, dict | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseShape:
    """The fields of every Response object of one request, and the object itself."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, tools: list[dict] | None) -> None:
        self.req, self.rid, self.model, self.tools = req, rid, model, tools or []
        self.created = int(time.time())

    def obj(self, status: str, output: list[dict], chat_usage: dict | None = None,
            incomplete: dict | None = None, error: dict | None = None) -> dict[str, Any]:
        req = self.req
        choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None \
            else req.tool_choice.model_dump()
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store,
                "temperature": 1.0 if req.temperature is None else req.temperature, "text": {"format": fmt},
                "tool_choice": choice or "auto", "tools": self.tools,
                "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
                "usage": usage(chat_usage), "user": req.user, "metadata": req.metadata or {}}

    def whole(self, chat: dict) -> dict[str, Any]:
        """The Response for a whole chat completion (n is 1)."""
        choice = chat["choices"][0]
        msg = choice["message"]
        output = [reasoning_item(msg["reasoning_content"])] if msg.get("reasoning_content") else []
        output += [message_item(msg["content"])] if msg.get("content") or not msg.get("tool_calls") else []
        output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
                   for c in msg.get("tool_calls") or []]
        status, incomplete = _status(choice["finish_reason"])
        return self.obj(status, output, chat["usage"], incomplete)


def assistant_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages that continue its conversation."""
    out: list[dict] = []
    for item in output:   # reasoning items stay out: chat templates drop earlier turns' thinking
        if item["type"] == "message":
            out.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return out


class ResponsesEvents:
    """The Responses stream's events, from the chat stream's chunk dicts: open an output item
    when its first piece comes, close it (its .done events) when the next one opens or the
    answer ends. `final` is the completed Response once the stream has ended; on_final(final) runs
    before its event goes out (the store says there whether it kept it)."""

    def __init__(self, shape: ResponseShape, on_final=None) -> None:
        self.shape = shape
        self.on_final = on_final
        self.seq = 0
        self.output: list[dict] = []     # closed items
        self.open: dict | None = None    # the item being written
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its item
        self.final: dict | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        snap = self.shape.obj("in_progress", [])
        return [self._event("response.created", response=snap), self._event("response.in_progress", response=snap)]

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        end = ChatEnd()
        async for delta in chat_deltas(chunks, end):
            if delta.get("reasoning_content"):
                for e in self._reasoning(delta["reasoning_content"]):
                    yield e
            if delta.get("content"):
                for e in self._text(delta["content"]):
                    yield e
            for call in delta.get("tool_calls") or []:
                for e in self._call(call):
                    yield e
        for e in self._close():
            yield e
        status, incomplete = _status(end.finish_reason)
        self.final = self.shape.obj(status, self.output, end.usage, incomplete)
        if self.on_final is not None:
            self.on_final(self.final)
        yield self._event("response.completed" if status == "completed" else "response.incomplete",
                          response=self.final)

    def failed(self, status: int, message: str) -> str:
        """The stream's last event when the answer cannot be finished."""
        code = "server_shutting_down" if status == 503 else "server_error"
        return self._event("response.failed", response=self.shape.obj(
            "failed", self.output, error={"code": code, "message": message}))

    def _opened(self, kind: str, make) -> list[str]:
        """The events that close the open item and open a `kind` one (make(text, status)),
        unless one is open already: then none."""
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close()
        self.open = make("", "in_progress")
        out.append(self._event("response.output_item.added", output_index=len(self.output),
                               item={**self.open, "content": []}))
        return out

    def _text(self, text: str) -> list[str]:
        out = self._opened("message", message_item)
        if out:   # a new message: its one content part
            out.append(self._event("response.content_part.added", item_id=self.open["id"],
                                   output_index=len(self.output), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.open["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _reasoning(self, text: str) -> list[str]:
        out = self._opened("reasoning", reasoning_item)
        self.open["content"][0]["text"] += text
        out.append(self._event("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.output),
                               content_index=0, delta=text))
        return out

    def _call(self, delta: dict) -> list[str]:
        out = []
        fn = delta.get("function") or {}
        if "id" in delta:  # a new call: its name and first arguments
            out += self._close()
            self.open = call_item(delta["id"], fn.get("name", ""), "", "in_progress")
            self.calls[delta["index"]] = self.open
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=dict(self.open)))
        item = self.calls.get(delta["index"])
        if item is not None and item is self.open and fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self.output), delta=fn["arguments"]))
        return out

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = len(self.output)
        item["status"] = "completed"
        out = []
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                   content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=idx,
                                   content_index=0, text=part["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=idx,
                                   content_index=0, part=part))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=idx, item=item))
        self.output.append(item)
        return out
