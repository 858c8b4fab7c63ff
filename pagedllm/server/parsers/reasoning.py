"""Reasoning parsers, chosen by name (vLLM's --reasoning-parser): a reasoning model's
`<think>...</think>` block split from its answer, into chat's `reasoning_content`.

A parser reads one choice's text as it streams and splits it into (reasoning, content)
pieces; a whole answer is read as a stream fed at once, so the two always agree. A tag
split across pieces is held back until it is whole. The answer after the block starts at
its first non-blank character. The server also holds a request's structured-output grammar
back until `END` (sampling_params.StructuredOutputsParams.reasoning_end): thinking is free.

- deepseek_r1: DeepSeek-R1 and its distills. Their template opens `<think>` in the prompt,
  so the output is reasoning from its first token (a `<think>` it writes anyway is dropped)
  until `</think>`; an output that never closes it is all reasoning, as vLLM's.
- qwen3: Qwen3. The output is reasoning only if it opens with `<think>`; without it
  (enable_thinking false, whose template closes an empty block in the prompt) it is all answer.
- openai_gptoss: gpt-oss's harmony messages (harmony.py): the analysis channel's are the
  reasoning, the final channel's the answer.

Each parser names the tags it reads (`tags`: kept in the text where they are special tokens),
where the answer starts (`answer_start`: a structured output's grammar waits for it), and
whether a prompt already closed the reasoning (`closed_by`).

This module imports nothing heavy: the CLI reads its names for --reasoning-parser.
"""
from __future__ import annotations

from collections.abc import Callable

from .base import partial_tag
from .harmony import HarmonySplitter

START, END = "<think>", "</think>"


class ThinkSplitter:
    """`<think>` reasoning `</think>` answer. starts_thinking: the prompt opened the block."""
    tags = (START, END)
    answer_start = END

    def __init__(self, starts_thinking: bool) -> None:
        self.state = "undecided"   # -> "thinking" -> "answer"; or straight to "answer"
        self.starts_thinking = starts_thinking
        self.held = ""             # text not yet told apart (a tag's first characters)
        self.answer_started = False

    @staticmethod
    def closed_by(prompt: str) -> bool:
        """Whether the prompt ends by closing the block (Qwen3's template with enable_thinking false
        writes an empty one there; blocks in earlier turns, a few-shot prompt's, say nothing)."""
        return prompt.rstrip().endswith(END)

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = "", ""
        if self.state == "undecided":
            head = self.held.lstrip()
            if len(head) < len(START) and START.startswith(head):
                return "", ""   # may still open with <think>
            opened = head.startswith(START)
            if opened:
                self.held = head[len(START):]
            self.state = "thinking" if opened or self.starts_thinking else "answer"
        if self.state == "thinking":
            end = self.held.find(END)
            if end < 0:
                keep = partial_tag(self.held, END)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(END):]
            self.state = "answer"
        content, self.held = self._answer(self.held), ""
        return reasoning, content

    def end(self) -> tuple[str, str]:
        rest, self.held = self.held, ""
        if self.state == "thinking" or (self.state == "undecided" and self.starts_thinking):
            return rest, ""
        return "", self._answer(rest)

    def _answer(self, text: str) -> str:
        if not self.answer_started:
            text = text.lstrip()
            self.answer_started = bool(text)
        return text


REASONING_PARSERS: dict[str, Callable[[], ThinkSplitter | HarmonySplitter]] = {
    "deepseek_r1": lambda: ThinkSplitter(starts_thinking=True),
    "qwen3": lambda: ThinkSplitter(starts_thinking=False),
    "openai_gptoss": HarmonySplitter,
}


def split_all(parser: ThinkSplitter | HarmonySplitter, text: str) -> tuple[str, str]:
    r1, c1 = parser.feed(text)
    r2, c2 = parser.end()
    return r1 + r2, c1 + c2
