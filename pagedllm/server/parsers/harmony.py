"""OpenAI's harmony format (gpt-oss): an answer is a run of messages, each a header and a body.

    <|channel|>analysis<|message|>The user asks for the weather...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>

The chat template ends the prompt with `<|start|>assistant`, so the first header begins at once.
A header names the message's channel (analysis: the reasoning; commentary: tool calls and the
preambles before them; final: the answer) and, for a tool call, its recipient (`to=functions.NAME`,
before or after the channel); `<|end|>` ends a message, `<|call|>` a tool call, `<|return|>` the
answer (the last two stop the generation).

- openai_gptoss (--reasoning-parser): analysis bodies are the reasoning; the answer is the final
  and commentary bodies, with each tool call's message kept whole in harmony's form for
  --tool-call-parser openai to read.
- openai (--tool-call-parser): messages to `functions.NAME` are calls (their body the arguments);
  final and commentary bodies are the content; analysis is reasoning, never content.

Text that does not open as a header (a model writing plain text) is all answer. Both read the
text as it streams; a tag cut between pieces is held back until whole. This module imports
nothing heavy: the CLI reads the parsers' names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .base import CallPart, Event, TrimmedContent, partial_tag, register

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
# Where the answer starts: a structured output's grammar waits for it (as it waits for </think>).
ANSWER_START = CHANNEL + "final" + MESSAGE
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_BODY_ENDS = (END, CALL, RETURN)
_NEXT_HEADER = (START, CHANNEL)   # a body never holds these: a header begins (a model that skips <|end|>)
_HEADER_OPENS = ("<|", "assistant", "to=")   # what a header may begin with


@dataclass(frozen=True)
class Piece:
    """Part of a message's body, with its header's channel and recipient ("" where none); `done`:
    the message ended here (its text may be empty)."""
    channel: str
    recipient: str
    text: str
    done: bool = False


class HarmonyReader:
    """Harmony text, fed as it streams, read into pieces of message bodies."""

    def __init__(self) -> None:
        self.held = ""
        self.header: tuple[str, str] | None = None   # (channel, recipient) of the open body; None: in a header

    def feed(self, text: str) -> list[Piece]:
        self.held += text
        out: list[Piece] = []
        while True:
            if self.header is None and not self._read_header():
                return out
            channel, recipient = self.header
            ends = [(i, tag) for tag in _BODY_ENDS + _NEXT_HEADER if (i := self.held.find(tag)) >= 0]
            if not ends:
                keep = max(partial_tag(self.held, tag) for tag in _BODY_ENDS + _NEXT_HEADER)
                body, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                if body:
                    out.append(Piece(channel, recipient, body))
                return out
            i, tag = min(ends)
            out.append(Piece(channel, recipient, self.held[:i], done=True))
            # an end tag is the message's; a header's opening tag (a body never holds one) the next one's
            self.held, self.header = self.held[i + (len(tag) if tag in _BODY_ENDS else 0):], None

    def end(self) -> list[Piece]:
        """What is held: an unfinished body's rest, or a header cut short (its text the answer
        where it does not read as a header, as plain text is)."""
        rest, self.held = self.held, ""
        if self.header is not None:
            return [Piece(*self.header, rest, done=True)] if rest else []
        return [Piece("final", "", rest, done=True)] if rest.strip() and not _may_open(rest.lstrip()) else []

    def _read_header(self) -> bool:
        """Reads a whole header off `held` into `header`; False while it is incomplete. Text that
        cannot open a header (plain text) is a final body's."""
        head = self.held.lstrip()
        if not head:
            return False
        if not _may_open(head):
            self.header = ("final", "")
            return True
        at = self.held.find(MESSAGE)
        if at < 0:
            return False
        text = self.held[:at].replace(START, " ")
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        self.header = (channel.group(1) if channel else "final", recipient.group(1) if recipient else "")
        self.held = self.held[at + len(MESSAGE):]
        return True


def _may_open(head: str) -> bool:
    """Whether text (no leading blanks) is, or may grow into, the start of a header."""
    return any(o.startswith(head[:len(o)]) for o in _HEADER_OPENS)


def call_markup(recipient: str, body: str) -> str:
    """A tool call's message in harmony's form (what openai's tool parser reads)."""
    return f"{CHANNEL}commentary to={recipient}{MESSAGE}{body}{CALL}"


class HarmonySplitter:
    """--reasoning-parser openai_gptoss: (reasoning, answer) pieces of a harmony answer; a tool
    call's message passes into the answer whole, in harmony's form, once it ends."""
    tags = TAGS
    answer_start = ANSWER_START

    def __init__(self) -> None:
        self.reader = HarmonyReader()
        self.calls: dict[str, str] = {}   # a recipient's body so far, until its message ends
        self.answer = TrimmedContent()

    def closed_by(self, prompt: str) -> bool:
        return False   # every answer may reason first

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self.reader.feed(text))

    def end(self) -> tuple[str, str]:
        reasoning, content = self._split(self.reader.end())
        for recipient, body in self.calls.items():   # a call cut short: its markup, unended
            content += f"{CHANNEL}commentary to={recipient}{MESSAGE}{body}"
        self.calls.clear()
        return reasoning, content + "".join(self.answer.add(""))

    def _split(self, pieces: list[Piece]) -> tuple[str, str]:
        reasoning, content = [], []
        for p in pieces:
            if p.recipient:
                body = self.calls.pop(p.recipient, "") + p.text
                if p.done:
                    content.append(call_markup(p.recipient, body))
                else:
                    self.calls[p.recipient] = body
            elif p.channel == "analysis":
                reasoning.append(p.text)
            else:
                content += self.answer.add(p.text)
        return "".join(reasoning), "".join(content)


@register("openai")
class HarmonyToolParser:
    """--tool-call-parser openai: calls to `functions.NAME` (their bodies the arguments, read whole
    when the call ends: a call cut short is the content's); final and commentary text the content."""
    tags = TAGS

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.reader = HarmonyReader()
        self.calls: dict[str, str] = {}
        self.content = TrimmedContent()

    def feed(self, text: str) -> list[Event]:
        return self._events(self.reader.feed(text))

    def end(self) -> list[Event]:
        events = self._events(self.reader.end())
        for body in self.calls.values():   # a call cut short: its arguments are the content's
            events += self.content.add(body)
        self.calls.clear()
        return events + self.content.add("")

    def _events(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        for p in pieces:
            if p.recipient:
                body = self.calls.pop(p.recipient, "") + p.text
                if not p.done:
                    self.calls[p.recipient] = body
                elif p.recipient.startswith("functions."):
                    events.append(CallPart(p.recipient.removeprefix("functions."), body.strip()))
                else:   # a built-in tool (browser, python) we do not run: its request stays text
                    events += self.content.add(body)
            elif p.channel != "analysis":
                events += self.content.add(p.text)
        return events
