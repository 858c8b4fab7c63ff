"""What every tool-call parser shares: the events a parser reads an answer into (content text
and pieces of calls), the protocol, the registry of parsers by name, and the pieces that hold
back text (a tag's first characters; whitespace around calls). The parsers themselves are in
tool_call_formats.py; tool_calls.py is where the server and the CLI find them."""
from __future__ import annotations

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


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
