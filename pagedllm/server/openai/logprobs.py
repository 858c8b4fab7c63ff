"""The engine's logprob entries (per token: the chosen or prompt token's Logprob first, then
the top k by rank) in the response shapes: OpenAI's completion `logprobs` object, OpenAI's
chat `logprobs.content`, and vLLM's `prompt_logprobs` list."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...outputs import Logprob

Entry = dict[int, Logprob]
# OpenAI's stand-in for -inf: JSON has no infinities, and a client's float parser must not fail.
MIN_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return max(x, MIN_LOGPROB)


def _kept(entry: Entry, k: int) -> list[tuple[int, Logprob]]:
    """The entry's own token and its top k: the engine may have scored more (the largest k of
    a request's views), never fewer."""
    own = next(iter(entry))
    return [(t, v) for t, v in entry.items() if t == own or (v.rank is not None and v.rank <= k)]


def completion_logprobs(entries: Sequence[Entry | None], k: int, offset: int = 0,
                        ids: Sequence[int] = (), text_of: Callable[[int], str] | None = None) -> dict:
    """OpenAI's completion logprobs (vLLM's shape): per token its text, its logprob, a dict
    of the top k and itself (text -> logprob; OpenAI returns up to k + 1), and its offset:
    the running length of the token texts from `offset` (where they start in the choice's
    text). A None entry (the first prompt token, which nothing predicts) gets nulls; its text
    is text_of(ids[j])."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for j, entry in enumerate(entries):
        offsets.append(offset)
        if entry is None:
            tok, lp, top = text_of(ids[j]), None, None
        else:
            chosen = entry[next(iter(entry))]
            tok, lp, top = chosen.decoded_token, _finite(chosen.logprob), _top_by_text(_kept(entry, k))
        tokens.append(tok)
        token_lps.append(lp)
        tops.append(top)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _top_by_text(kept: list[tuple[int, Logprob]]) -> dict[str, float]:
    """Two tokens may share a text (byte pieces of one character): the text keeps the higher
    logprob, so a client's greedy check (the chosen logprob is the dict's maximum) stays right."""
    top: dict[str, float] = {}
    for _, v in kept:
        lp = _finite(v.logprob)
        if v.decoded_token not in top or lp > top[v.decoded_token]:
            top[v.decoded_token] = lp
    return top


def chat_logprobs(entries: Sequence[Entry], k: int) -> dict:
    """OpenAI's chat logprobs: per output token, itself and its top k by rank (not itself)."""
    content = []
    for entry in entries:
        chosen = entry[next(iter(entry))]
        tops = sorted(((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= k),
                      key=lambda e: e[1].rank)
        content.append({**_chat_token(chosen), "top_logprobs": [_chat_token(v) for _, v in tops]})
    return {"content": content}


def _chat_token(v: Logprob) -> dict[str, Any]:
    tok = v.decoded_token  # decoded once, by the engine
    return {"token": tok, "logprob": _finite(v.logprob), "bytes": list(tok.encode())}


def vllm_prompt_logprobs(entries: Sequence[Entry | None], k: int) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id (a JSON
    string key): {"logprob", "rank", "decoded_token"}}, the prompt token first, then its top k."""
    return [None if e is None else {str(t): {"logprob": _finite(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token} for t, v in _kept(e, k)}
            for e in entries]
