"""Speculative decoding, the engine's side: who may draft (SpecPolicy) and what it achieved
(SpecStats). The runtime proposes drafts after sampling (runtime/spec_decode.py: n-gram
lookup, or a draft model); the scheduler gives the next step's drafts slots, the runner
verifies them all in one forward, and the KV manager rolls back the rejected. Plain Python."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..config import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class SpecPolicy:
    """What the scheduler decides of speculation: who may carry drafts this step, and the
    lookahead slots a draft model writes its next proposal into (after sampling, in the
    runtime, as vLLM v1's proposers do). The proposers themselves live in the runtime."""
    num_speculative_tokens: int
    disable_by_batch_size: int | None = None
    # Slots kept past a sequence's last computed token: the draft model writes the KV of
    # the token just sampled and of its own drafts there (0 for n-gram lookup).
    num_lookahead_tokens: int = 0

    @classmethod
    def of(cls, cfg: SpeculativeConfig) -> SpecPolicy:
        k = cfg.num_speculative_tokens
        return cls(k, cfg.disable_by_batch_size, k if cfg.method == "draft_model" else 0)


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
