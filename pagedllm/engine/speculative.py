"""Speculative decoding's drafts and counts: n-gram prompt lookup (no extra weights).

A sequence that repeats itself (code being edited, a document quoted back, a list that
follows a pattern) has its next tokens already in its context: after the latest earlier
occurrence of its last n tokens. The scheduler gives those draft tokens lookahead slots,
the runner verifies them all in one forward, and the KV manager rolls back the rejected.
Plain Python, no torch."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..config import SpeculativeConfig


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-grams -> where their latest occurrence ends, built incrementally:
    each step adds the n-grams ending at the new tokens, never rescans the context."""
    n_min: int
    n_max: int
    # ends[n - n_min][ngram] = end (exclusive) of its latest occurrence among those indexed
    ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    indexed: int = 0          # n-grams ending at positions < indexed are in `ends`

    def __post_init__(self) -> None:
        self.ends = [{} for _ in range(self.n_max - self.n_min + 1)]

    def catch_up(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending before `upto`."""
        for end in range(max(self.indexed, self.n_min), upto):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.ends[n - self.n_min][tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        suffix of `tokens` (of n_max down to n_min tokens) seen before; [] if none."""
        L = len(tokens)
        self.catch_up(tokens, L)  # earlier occurrences only: they end before the suffix does
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            end = self.ends[n - self.n_min].get(tuple(tokens[L - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramProposer:
    runner_drafts = False

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.k = cfg.num_speculative_tokens
        self.n_min, self.n_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.disable_by_batch_size = cfg.disable_by_batch_size

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.n_min, self.n_max)

    def propose(self, index: NgramIndex, tokens: list[int], limit: int) -> list[int]:
        """At most min(k, limit) draft tokens for the sequence of `tokens`."""
        k = min(self.k, limit)
        return index.propose(tokens, k) if k > 0 else []


class DraftModelProposer:
    """A draft model drafts in the runner: the scheduler only reserves k lookahead slots
    (placeholder tokens, -1) that the runner's draft model fills before the verify forward."""
    runner_drafts = True

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.k = cfg.num_speculative_tokens
        self.disable_by_batch_size = cfg.disable_by_batch_size

    def new_index(self) -> None:
        return None

    def propose(self, index: None, tokens: list[int], limit: int) -> list[int]:
        return [-1] * max(0, min(self.k, limit))


def make_proposer(cfg: SpeculativeConfig) -> NgramProposer | DraftModelProposer:
    return DraftModelProposer(cfg) if cfg.method == "draft_model" else NgramProposer(cfg)


@dataclass
class SpecStats:
    """What speculation achieved (vLLM's spec_decode counters): drafts verified, draft
    tokens proposed and accepted; the acceptance rate is accepted / drafted."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose token i was accepted (the first drafts tokens
    # are accepted most often: how deep speculation pays)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average: accepted drafts plus the one sampled."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def snapshot(self) -> "SpecStats":
        """A copy the engine thread will not change under a reader."""
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_position))

    @classmethod
    def total(cls, parts: "list[SpecStats | None]") -> "SpecStats | None":
        """The sum over replicas (None if none speculates)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        out = cls()
        for p in parts:
            out.num_drafts += p.num_drafts
            out.num_draft_tokens += p.num_draft_tokens
            out.num_accepted_tokens += p.num_accepted_tokens
            out.accepted_per_position = [a + b for a, b in itertools.zip_longest(
                out.accepted_per_position, p.accepted_per_position, fillvalue=0)]
        return out
