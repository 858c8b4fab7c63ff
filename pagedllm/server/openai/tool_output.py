"""Tool calls on the response side: a chat choice's text read into OpenAI's `tool_calls`,
whole (`message.tool_calls`) or as it streams (`delta.tool_calls`, a call's id, type and
name in its first delta, its arguments in pieces after).

What reads the text depends on the tool mode: a forced call's schema-shaped JSON (named or
"required"), or the --tool-call-parser's reading of free text ("auto"). A whole response is
read as a stream fed all at once, so the two always agree.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..parsers.tool_calls import CallPart, Event, ToolParser


@dataclass(frozen=True)
class ToolOutput:
    mode: str                                         # "auto", "required" or "named"
    name: str | None = None                           # named: the function's
    parser: Callable[[], ToolParser] | None = None    # auto: the server's tool-call parser
    parallel: bool = True                             # parallel_tool_calls: false keeps the first call

    def stream(self) -> ChoiceCalls:
        if self.mode == "named":
            return ChoiceCalls(self, _NamedCall(self.name or ""))
        if self.mode == "required":
            return ChoiceCalls(self, _CallArray())
        assert self.parser is not None
        return ChoiceCalls(self, self.parser())

    def needs_special_tokens(self, tokenizer) -> bool:
        """Whether the parser's tags are special tokens of this tokenizer: skipping special
        tokens would drop them from the text it reads (vLLM's hermes parser keeps them too)."""
        tags = self.parser().tags if self.parser is not None else ()
        return bool(set(tags) & set(tokenizer.all_special_tokens))

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish_reason. A call whose arguments are not JSON
        (a forced call cut short by max_tokens) stays in the content."""
        calls = self.stream()
        content, deltas = calls.feed(text)
        rest, more = calls.end()
        whole = _merged(deltas + more)
        good = [c for c in whole if _is_json(c["function"]["arguments"])]
        content += rest + "".join(c["function"]["arguments"] for c in whole if c not in good)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not good else None}
        if good:
            msg["tool_calls"] = good
        return msg, self.finish_reason(len(good), finish)

    def finish_reason(self, calls: int, finish: str | None) -> str | None:
        """vLLM's: "tool_calls" for calls the model chose to end with (auto, required); a
        named call ends as any answer does, and a cut-short output keeps "length"."""
        return "tool_calls" if calls and self.mode != "named" and finish == "stop" else finish


class ChoiceCalls:
    """One choice's reading: text in, (content, tool_calls deltas) out."""

    def __init__(self, out: ToolOutput, source: ToolParser) -> None:
        self.out, self.source = out, source
        self.calls = 0          # calls opened so far
        self.dropping = False   # inside a call past the first, with parallel_tool_calls false

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return self._deltas(self.source.feed(text))

    def end(self) -> tuple[str, list[dict]]:
        return self._deltas(self.source.end())

    def _deltas(self, events: list[Event]) -> tuple[str, list[dict]]:
        content, deltas = [], []
        for e in events:
            if isinstance(e, str):
                content.append(e)
            elif e.name is not None:
                self.dropping = not self.out.parallel and self.calls >= 1
                if not self.dropping:
                    deltas.append({"index": self.calls, "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                                   "type": "function", "function": {"name": e.name, "arguments": e.arguments}})
                    self.calls += 1
            elif not self.dropping and self.calls:
                deltas.append({"index": self.calls - 1, "function": {"arguments": e.arguments}})
        return "".join(content), deltas


def _merged(deltas: list[dict]) -> list[dict]:
    """Stream deltas folded into whole calls (a message's tool_calls have no index)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"], "arguments": ""}}
        calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class _NamedCall:
    """A named tool choice: the whole output is the call's arguments, sent as they come."""
    tags: tuple[str, ...] = ()

    def __init__(self, name: str) -> None:
        self.name, self.opened = name, False

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        part = CallPart(None if self.opened else self.name, text)
        self.opened = True
        return [part]

    def end(self) -> list[Event]:
        return []


class _CallArray:
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects
    (its schema sees to that); each object is a call once it closes. What is not such an
    array (nothing constrained it) is content."""
    tags: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.depth = 0        # 0 outside the array, 1 between its items, 2+ inside one
        self.text = ""        # the open item's text; once broken, content not yet sent
        self.between = ""     # what was skipped since the last item (brackets, commas, spaces)
        self.in_str = self.esc = False
        self.broken = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            if self.broken:
                self.text += ch
            elif self.depth >= 2:
                self._inside(ch, events)
            else:
                self._between(ch)
        if self.broken and self.text:
            events.append(self.text)
            self.text = ""
        return events

    def end(self) -> list[Event]:
        rest = self.text if (self.broken or self.depth >= 2) else ""
        self.text, self.depth = "", 0
        return [rest] if rest else []

    def _between(self, ch: str) -> None:
        self.between += ch
        if ch.isspace() or (self.depth == 1 and ch == ","):
            return
        if self.depth == 0 and ch == "[":
            self.depth = 1
        elif self.depth == 1 and ch == "]":
            self.depth = 0
        elif self.depth == 1 and ch == "{":
            self.depth, self.text, self.between = 2, "{", ""
        else:
            self.broken, self.text = True, self.between

    def _inside(self, ch: str, events: list[Event]) -> None:
        self.text += ch
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
            return
        if ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                events.append(_array_item(self.text))
                self.text = ""


def _array_item(text: str) -> Event:
    try:
        obj = json.loads(text)
    except ValueError:
        return text
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("parameters"), dict):
        return text
    return CallPart(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))
