"""Structured outputs in the batched step: each constrained sequence's grammar matcher,
the token bitmask of its rows, and the mask applied to the logits before sampling.

A matcher follows its sequence's output tokens: it is synced to them at the start of
every step (built from them when missing: a new sample of n, a sequence recomputed after
preemption), advanced by the tokens the step keeps, and rolled back from the drafts a
verification rejects. Rows of unconstrained sequences are never read or written.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..plan import SampleTarget


class GrammarRow(NamedTuple):
    row: int                # the logits row sampling (or verifying) the next token
    target: SampleTarget
    draft: list[int]        # a speculating decode's drafts: rows row+1.. score the tokens after them


class GrammarMatchers:
    """The runner's matchers by seq id, kept until the sequence finishes."""

    def __init__(self, vocab_size: int, kernels=None) -> None:
        self.vocab_size = vocab_size
        self.kernels = kernels
        self._matchers: dict[int, tuple[object, int]] = {}   # seq id -> (matcher, its output tokens)
        self._bitmask: torch.Tensor | None = None

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def mask(self, logits: torch.Tensor, rows: list[GrammarRow]) -> tuple[dict[int, str], set[int]]:
        """Apply each constrained row's grammar to `logits` in place; returns the error of
        each sequence whose matcher could not follow its tokens (it fails alone), and which
        of those the request's own parameters caused."""
        errors: dict[int, str] = {}
        invalid: set[int] = set()
        bitmask = self._buffer(sum(1 + len(r.draft) for r in rows))
        at: list[int] = []
        for r in rows:
            try:
                m = self._synced(r.target)
            except ValueError as e:
                errors[r.target.seq_id] = str(e)
                continue
            if m.is_terminated():  # ended by its stop token, yet asked for more (ignore_eos)
                errors[r.target.seq_id] = ("structured outputs: the output is complete, but ignore_eos asks for "
                                           "more tokens than the grammar allows")
                invalid.add(r.target.seq_id)
                continue
            m.fill_next_token_bitmask(bitmask, len(at))
            at.append(r.row)
            tried = 0
            for i, token in enumerate(r.draft):  # row i + 1 scores the token after draft[:i + 1]
                if not m.accept_token(token):
                    break  # its own row forbids it: verification rejects it there
                tried += 1
                m.fill_next_token_bitmask(bitmask, len(at))
                at.append(r.row + i + 1)
            if tried:
                m.rollback(tried)
        if at:
            self._apply(logits, bitmask[:len(at)], at)
        return errors, invalid

    def advance(self, target: SampleTarget, tokens: list[int]) -> str | None:
        """The step kept `tokens` after the target's output so far (accepted drafts, then
        the sampled one): the matcher takes them. An error message if it cannot."""
        entry = self._matchers.get(target.seq_id)
        if entry is None:
            return None
        m, n = entry
        for i, token in enumerate(tokens):
            if not m.accept_token(token):
                self._matchers.pop(target.seq_id)
                return (f"structured outputs: token {token} does not continue the grammar (every token was "
                        "forbidden at this point: is min_tokens or ignore_eos holding back the end?)")
        self._matchers[target.seq_id] = (m, n + len(tokens))
        return None

    def _synced(self, t: SampleTarget):
        """The target's matcher at its output tokens so far."""
        import xgrammar as xgr

        start = t.grammar_from or 0   # the output before it is a reasoning model's thinking, free
        out = t.num_output_tokens - start
        entry = self._matchers.get(t.seq_id)
        m, n = entry if entry is not None else (None, 0)
        if m is not None and n > out:  # tokens it took were dropped since (a stop string's tail)
            m.rollback(n - out)
            n = out
        if m is None:
            m, n = xgr.GrammarMatcher(t.grammar.compiled), 0
        for token in t.token_ids[t.num_prompt_tokens + start + n:]:
            if not m.accept_token(token):
                self._matchers.pop(t.seq_id, None)
                raise ValueError(f"structured outputs: output token {token} does not follow the grammar")
        self._matchers[t.seq_id] = (m, out)
        return m

    def _buffer(self, rows: int) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty((max(rows, 64), words), dtype=torch.int32)
        return self._bitmask

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, at: list[int]) -> None:
        rows = torch.tensor(at, dtype=torch.int64)
        if self.kernels is not None and logits.device.type == "cpu" and logits.is_contiguous():
            self.kernels.apply_token_bitmask(logits, bitmask, rows)
            return
        # Elsewhere (GPU, no compiler): unpack the bits on the logits' device.
        dev = logits.device
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        bits = bitmask.to(dev)
        allowed = ((bits[:, :, None] >> shifts) & 1).reshape(bits.shape[0], -1)[:, :logits.shape[1]].bool()
        idx = rows.to(dev)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
