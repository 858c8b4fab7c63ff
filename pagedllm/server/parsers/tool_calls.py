"""Tool-call parsers for `tool_choice: "auto"`, chosen by name (vLLM's --tool-call-parser).

A parser reads a model's free text, as it streams, into events: plain text (the message's
content) and tool calls. Each parser knows one model family's way of writing calls, and is
made for one answer with the request's tools (OpenAI's shape), whose schemas it may read; a
new one registers itself with `@register("name")` in tool_call_formats.py. A call that does
not parse stays in the content, as text: a model's malformed call is its answer, never a
server error.

This module imports nothing heavy: the CLI reads its names for --tool-call-parser.
"""
from __future__ import annotations

from . import harmony, tool_call_formats  # noqa: F401  (the parsers register themselves by name)
from .base import TOOL_PARSERS, CallPart, Event, ToolParser, TrimmedContent, parse_all, partial_tag, register
from .tool_call_formats import HermesParser

__all__ = ["TOOL_PARSERS", "CallPart", "Event", "HermesParser", "ToolParser", "TrimmedContent", "parse_all",
           "partial_tag", "register"]
