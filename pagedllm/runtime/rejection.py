"""Verifying draft tokens: which of a sequence's drafts the target model keeps, and the
token it adds after them, from the d + 1 logits rows of one forward.

Row i scores the token after draft[:i]. Greedy keeps drafts while each is the row's
argmax, then takes the argmax of the first row that disagrees (or of the last row): the
tokens greedy decoding one at a time would give. Sampling keeps draft i with probability
p_i(draft_i), p_i being row i's sampling distribution (temperature, top-k, top-p and the
logits processors, applied as if the drafts before it were already output); at the first
rejection it draws from p_i without the rejected token (renormalised), else from the last
row. For a draft that is a single proposed token (n-gram lookup), that is the rejection
sampling rule of Leviathan et al. and Chen et al. (2023): every token kept or drawn is
distributed exactly as p, so speculation changes the speed, never the distribution."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..plan import SampleTarget
from .logits_processors import process_logits
from .sampler import generator, race, weights


class Verify(NamedTuple):
    row: int                 # the logits row scoring the token after the chunk's real last token
    target: SampleTarget
    draft: list[int]


def verify(logits: torch.Tensor, entries: list[Verify], eos_ids: frozenset[int],
           gens: dict[int, torch.Generator]) -> tuple[dict[int, list[int]], dict[int, int], dict[int, str]]:
    """(accepted drafts, the token after them, sampling errors) by seq id. One bad request
    fails alone: its error is returned, the others are verified."""
    accepted: dict[int, list[int]] = {}
    tokens: dict[int, int] = {}
    errors: dict[int, str] = {}
    # The plain greedy rows of the whole step in one max, not one per sequence.
    argmax = None
    if any(e.target.params.greedy and not e.target.params.penalized for e in entries):
        argmax = logits.max(dim=-1).indices.tolist()
    for e in entries:
        t = e.target
        try:
            d = len(e.draft)
            if t.params.greedy and not t.params.penalized:
                best = argmax[e.row:e.row + d + 1]
            else:
                rows = _processed(logits[e.row:e.row + d + 1], t, e.draft, eos_ids)
                if t.params.greedy:
                    best = rows.max(dim=-1).indices.tolist()
                else:
                    accepted[t.seq_id], tokens[t.seq_id] = _sampled(rows, t, e.draft, gens)
                    continue
            a = 0
            while a < d and best[a] == e.draft[a]:
                a += 1
            accepted[t.seq_id], tokens[t.seq_id] = e.draft[:a], best[a]
        except Exception as ex:  # this request only
            accepted.pop(t.seq_id, None)
            errors[t.seq_id] = f"sampling failed: {type(ex).__name__}: {ex}"
    return accepted, tokens, errors


def _processed(rows: torch.Tensor, t: SampleTarget, draft: list[int], eos_ids: frozenset[int]) -> torch.Tensor:
    """The rows after the logits processors, row i seeing draft[:i] as output already
    (penalties count them, min_tokens counts them)."""
    if not t.params.penalized:
        return rows
    targets = [[dataclasses.replace(t, token_ids=t.token_ids + draft[:i])] for i in range(len(draft) + 1)]
    return process_logits(rows, targets, eos_ids)


def _sampled(rows: torch.Tensor, t: SampleTarget, draft: list[int], gens: dict) -> tuple[list[int], int]:
    gen = generator(t, gens)
    u = torch.rand(len(draft), generator=gen).tolist()
    for i, tok in enumerate(draft):
        w = weights(rows[i], t.params)
        total = float(w.sum())
        if u[i] < float(w[tok]) / total:
            continue
        w[tok] = 0.0  # the residual max(0, p - q) of a one-token draft q: p without it
        return draft[:i], race(w, gen)
    return list(draft), race(weights(rows[len(draft)], t.params), gen)
