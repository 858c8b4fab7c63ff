"""Incremental detokenization: each call decodes only a short window of ids, not the whole
output, so streaming and stop strings cost O(1) per token instead of O(n).

The window is vLLM's prefix/read offsets (the same scheme as `tokenizers`' DecodeStream):
the text of ids[prefix:] minus the text of ids[prefix:read] is what ids[read:] add. The
prefix gives the decoder its context: a byte-level or SentencePiece token decodes
differently alone than after its neighbour (a leading space, half of a UTF-8 character).
We decode with the tokenizer's own `decode`, so every normalizing step a full decode
applies is applied here too, and the text stays identical to `decode(all ids)`."""
from __future__ import annotations

from dataclasses import dataclass

# A character split over byte-fallback or byte-level tokens decodes to U+FFFD until its
# last byte arrives: hold the text back until then, so no stream ever shows it.
INCOMPLETE = "\ufffd"


def token_text(tokenizer, token_id: int) -> str:
    """One token's text alone (vLLM's decoded_token): what a logprob entry names."""
    return tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])


@dataclass(slots=True)
class DetokState:
    prefix: int = 0   # first output id of the context window (0 = first output token)
    read: int = 0     # output ids before this one are in the text already


def detokenize(tokenizer, ids: list[int], start: int, state: DetokState, skip_special_tokens: bool,
               final: bool = False, end: int | None = None) -> str:
    """The text that ids[start + state.read:end] add (the output begins at `start`, so the
    caller need not copy it out; `end` defaults to all of ids); advances state. Text
    ending in a broken character is held back until more ids complete it, or until
    `final`, when it is emitted as a full decode would (with U+FFFD)."""
    end = len(ids) if end is None else end
    if start + state.read >= end:
        return ""
    before = tokenizer.decode(ids[start + state.prefix:start + state.read], skip_special_tokens=skip_special_tokens)
    after = tokenizer.decode(ids[start + state.prefix:end], skip_special_tokens=skip_special_tokens)
    if not final and (len(after) <= len(before) or after.endswith(INCOMPLETE)):
        return ""
    # The next window starts at the ids just read: context enough for any decoder we load.
    state.prefix, state.read = state.read, end - start
    return after[len(before):]


def final_text(tokenizer, ids: list[int], start: int, state: DetokState, skip_special_tokens: bool,
               text: str) -> str:
    """The whole output text once generation ended: `text` plus what is left. If the output
    ends inside a character, decode it all once: a ByteFallback decoder turns the whole run
    of byte tokens around a broken character into U+FFFDs, already streamed ones included."""
    new = detokenize(tokenizer, ids, start, state, skip_special_tokens, final=True)
    if INCOMPLETE in new:
        return tokenizer.decode(ids[start:], skip_special_tokens=skip_special_tokens)
    return text + new
