"""Tool-call parsers for `tool_choice: "auto"`, chosen by name (vLLM's --tool-call-parser).

A parser reads a model's free text, as it streams, into events: plain text (the message's
content) and tool calls. Each parser knows one model family's way of writing calls, and is
made for one answer with the request's tools (OpenAI's shape), whose schemas it may read; a
new one registers itself with `@register("name")` (more in tool_call_formats.py). A call that does not parse stays in the
content, as text: a model's malformed call is its answer, never a server error.

This module imports nothing heavy: the CLI reads its names for --tool-call-parser.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class CallPart:
    """A piece of a tool call: `name` set opens a new call, None continues the open one.
    `arguments` is JSON text (complete once the call's parts are all in)."""
    name: str | None
    arguments: str


Event = str | CallPart  # str: content text


class ToolParser(Protocol):
    """One choice's output, fed as it arrives; `end` flushes what is held back."""
    # Tags that a tokenizer may hold as special tokens: those must stay in the text.
    tags: tuple[str, ...]

    def feed(self, text: str) -> list[Event]: ...

    def end(self) -> list[Event]: ...


TOOL_PARSERS: dict[str, Callable[..., ToolParser]] = {}   # name -> parser(tools=...)


def register(name: str):
    def add(cls):
        TOOL_PARSERS[name] = cls
        return cls
    return add


def parse_all(parser: ToolParser, text: str) -> list[Event]:
    """A whole output's events: the same as streaming it, by construction."""
    return parser.feed(text) + parser.end()


class TrimmedContent:
    """Content with its leading and trailing whitespace dropped, as it streams: whitespace is
    held until text follows it, so streamed and whole answers have the same content (the
    newlines around a tool call are layout, not an answer)."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def add(self, text: str) -> list[Event]:
        text = self.held + text
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        body = text.rstrip()
        self.held = text[len(body):]
        return [body] if body else []


@register("hermes")
class HermesParser:
    """Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number of them; text outside the tags is content. A call left open at the end (the
    output cut short) is read if its JSON is complete."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    tags = (OPEN, CLOSE)

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.pending = ""      # text not yet told apart
        self.in_call = False
        self.content = TrimmedContent()

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while True:
            if self.in_call:
                end = self.pending.find(self.CLOSE)
                if end < 0:
                    return events
                events += self._call(self.pending[:end], closed=True)
                self.pending = self.pending[end + len(self.CLOSE):]
                self.in_call = False
            else:
                start = self.pending.find(self.OPEN)
                if start < 0:
                    keep = partial_tag(self.pending, self.OPEN)  # "<tool" may be a tag's start
                    events += self.content.add(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    return events
                events += self.content.add(self.pending[:start])
                self.pending = self.pending[start + len(self.OPEN):]
                self.in_call = True

    def end(self) -> list[Event]:
        rest, self.pending = self.pending, ""
        if self.in_call:
            self.in_call = False
            return self._call(rest, closed=False)
        return self.content.add(rest)

    def _call(self, body: str, closed: bool) -> list[Event]:
        call = _json_call(body)
        if call is not None:
            return [call]
        return self.content.add(self.OPEN + body + (self.CLOSE if closed else ""))


def _json_call(body: str) -> CallPart | None:
    """{"name": str, "arguments": object} as a call, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return CallPart(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


from . import tool_call_formats  # noqa: E402,F401  (registers llama3_json, mistral, pythonic, qwen3_coder)
