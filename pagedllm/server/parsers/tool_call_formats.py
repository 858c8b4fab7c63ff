"""Model families' ways of writing tool calls, each a parser registered by name:

- hermes (Hermes, Qwen2.5): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number of them, text around them the content;
- llama3_json (Llama 3.1-3.3): the answer is `{"name": ..., "parameters": {...}}`, maybe after
  `<|python_tag|>`, several joined by `;`;
- mistral: content, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"} (v3
  tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` once per call (v11 and later);
- pythonic (Llama 3.2 / 4, ToolACE): the answer is a Python list of calls,
  `[get_weather(city="Paris"), get_time(tz="UTC")]`, read with `ast` (literals only, never run);
- qwen3_coder (Qwen3-Coder): `<tool_call><function=name><parameter=key>value</parameter>...
  </function></tool_call>`, each value typed by the tool's schema.

An answer that opens as calls is held until it ends and then read whole (its calls stream as
one delta each); what does not read as calls is the answer's content, as with hermes.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from .base import CallPart, Event, TrimmedContent, partial_tag, register


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



class _HeldCalls:
    """An answer that opens with `opening` (after blanks) is calls, held to the end; any other is
    content as it streams. Subclasses read the held text (`read`: events, or None if no calls)."""
    tags: tuple[str, ...] = ()
    openings: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []
        self.held = ""
        self.mode: str | None = None   # None until the opening tells, then "calls" or "content"
        self.content = TrimmedContent()

    def feed(self, text: str) -> list[Event]:
        self.held += text
        if self.mode is None:
            head = self.held.lstrip()
            if not head or any(o.startswith(head) and o != head for o in self.openings):
                return []
            self.mode = "calls" if head.startswith(self.openings) else "content"
        if self.mode == "content":
            text, self.held = self.held, ""
            return self.content.add(text)
        return []

    def end(self) -> list[Event]:
        text, self.held = self.held, ""
        if self.mode == "calls":
            events = self.read(text.strip())
            if events is not None:
                return events
        return self.content.add(text)

    def read(self, text: str) -> list[Event] | None:
        raise NotImplementedError


def _call(name: Any, args: Any) -> CallPart | None:
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return CallPart(name, json.dumps(args, ensure_ascii=False))


@register("llama3_json")
class Llama3JsonParser(_HeldCalls):
    PYTHON_TAG = "<|python_tag|>"
    tags = (PYTHON_TAG,)
    openings = ("{", PYTHON_TAG)

    def read(self, text: str) -> list[Event] | None:
        text = text.removeprefix(self.PYTHON_TAG).strip()
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(text):
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments", {}))) \
                if isinstance(obj, dict) else None
            if call is None:
                return None
            calls.append(call)
            i = _skip(text, i, ";")
        return calls or None


def _skip(text: str, i: int, sep: str) -> int:
    """Past blanks and one separator after position i."""
    while i < len(text) and text[i].isspace():
        i += 1
    if text.startswith(sep, i):
        i += len(sep)
    while i < len(text) and text[i].isspace():
        i += 1
    return i


@register("mistral")
class MistralParser:
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    tags = (TAG, ARGS)

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.pending = ""
        self.calling = False   # past the first [TOOL_CALLS]: the rest is held to the end
        self.content = TrimmedContent()

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        if self.calling:
            return []
        at = self.pending.find(self.TAG)
        if at < 0:
            keep = partial_tag(self.pending, self.TAG)
            out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            return self.content.add(out)
        before, self.pending, self.calling = self.pending[:at], self.pending[at:], True
        return self.content.add(before)

    def end(self) -> list[Event]:
        rest, self.pending = self.pending, ""
        if self.calling:
            calls = self._read(rest)
            if calls is not None:
                return calls
        return self.content.add(rest)

    def _read(self, text: str) -> list[Event] | None:
        parts = [p.strip() for p in text.split(self.TAG) if p.strip()]
        calls: list[Event] = []
        for part in parts:
            if part.startswith("["):   # v3: one JSON array of calls
                try:
                    items = json.loads(part)
                except ValueError:
                    return None
                found = [_call(o.get("name"), o.get("arguments", {})) if isinstance(o, dict) else None
                         for o in (items if isinstance(items, list) else [])]
            else:                       # v11: name[ARGS]{...}
                name, sep, args = part.partition(self.ARGS)
                try:
                    found = [_call(name.strip(), json.loads(args))] if sep else [None]
                except ValueError:
                    return None
            if not found or any(c is None for c in found):
                return None
            calls += found
        return calls or None


@register("pythonic")
class PythonicParser(_HeldCalls):
    openings = ("[",)

    def read(self, text: str) -> list[Event] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls: list[Event] = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:   # literals only: nothing the model wrote is ever run
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
            call = _call(node.func.id, args)
            if call is None or len(args) != len(node.keywords):
                return None
            calls.append(call)
        return calls


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


@register("qwen3_coder")
class Qwen3CoderParser(HermesParser):
    """Hermes' tags around an XML-like body; parameter values are text, typed by the tool's
    JSON schema (a string stays as written, less the newlines around it; other types are
    read as JSON, and stay text if they are not)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__()
        self.types = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties", {})
                      for t in tools or [] if isinstance(t.get("function"), dict)}

    def _call(self, body: str, closed: bool) -> list[Event]:
        m = _FUNCTION.search(body)
        if m is not None:
            props = self.types.get(m.group(1), {})
            args = {k: self._value(v, props.get(k)) for k, v in _PARAMETER.findall(m.group(2))}
            return [CallPart(m.group(1), json.dumps(args, ensure_ascii=False))]
        return self.content.add(self.OPEN + body + (self.CLOSE if closed else ""))

    @staticmethod
    def _value(text: str, schema: dict | None) -> Any:
        text = text.strip("\n")
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text
