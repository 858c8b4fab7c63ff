"""N-gram prompt lookup (no extra weights): a sequence that repeats itself (code being
edited, a document quoted back, a list that follows a pattern) has its next tokens already
in its context, after the latest earlier occurrence of its last n tokens. Plain Python."""
from __future__ import annotations

from dataclasses import dataclass, field


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
