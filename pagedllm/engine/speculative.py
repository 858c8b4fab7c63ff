"""Speculative decoding, the engine's side: who may draft (SpecPolicy), what it achieved
(SpecStats), and its part in each step (Speculation, a StepHook). The runtime proposes
drafts after sampling (runtime/spec_decode.py: n-gram lookup, or a draft model); the
scheduler gives the next step's drafts slots, the runner verifies them all in one forward,
and the KV manager rolls back the rejected. Plain Python."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from ..config import SpeculativeConfig
from ..plan import ChunkPlan, StepResult
from ..util import cdiv
from .hooks import StepHook
from .sequence import Sequence
from .step_types import ScheduledSeq


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


class Speculation(StepHook):
    """Speculative decoding's part in a step: a decode carries the drafts the runtime proposed
    after its last step (within the budget, its max_tokens and max_model_len), in lookahead
    slots; after the forward, the accepted run is kept and the rejected slots roll back."""

    def __init__(self, policy: SpecPolicy, tokens_left: Callable[[Sequence], int]) -> None:
        """tokens_left(seq): output tokens the sequence may still add (the one length rule)."""
        self.policy = policy
        self.tokens_left = tokens_left
        self.stats = SpecStats()

    def speculates(self, seq: Sequence) -> bool:
        """Whether a sequence drafts this step. Beams and requests that ask for logprobs (or
        rank samples by them) decode one token a step; so does everyone in a batch of at
        least disable_by_batch_size sequences."""
        p = seq.params
        if seq.request.beam is not None or p.logprobs is not None or p.ranks_samples:
            return False
        limit = self.policy.disable_by_batch_size
        return not (limit and len(self.scheduler.running) >= limit)

    def decode_extra(self, seq: Sequence, room: int) -> int:
        seq.draft = []
        if not seq.spec_tokens or not self.speculates(seq):
            return 0
        limit = min(room, self.tokens_left(seq) - 1)
        if limit <= 0:
            return 0
        seq.draft = seq.spec_tokens[:limit]
        return len(seq.draft)

    def drop_extra(self, seq: Sequence) -> int:
        n, seq.draft = len(seq.draft), []
        return n

    def lookahead(self, seq: Sequence, end: int) -> int:
        """Slots to hold past `end` for a draft model's next proposal (never past max_model_len;
        beams never draft). Held by every such sequence whether it drafts this step or not,
        so what a table holds only grows between steps."""
        if seq.request.beam is not None:
            return 0
        return max(0, min(self.policy.num_lookahead_tokens, self.scheduler.max_model_len - end))

    def preempted(self, seq: Sequence) -> None:
        seq.draft = []
        seq.spec_tokens = []

    def plan(self, chunk: ChunkPlan, s: ScheduledSeq) -> None:
        """A sequence that samples alone proposes drafts for its next step after sampling, into
        the lookahead blocks past its chunk."""
        if len(s.sample_for) != 1 or not self.speculates(s.seq):
            return
        chunk.samples[0].num_spec = self.policy.num_speculative_tokens
        table, B = self.scheduler.kv.block_table(s.seq.seq_id), self.scheduler.kv.block_size
        chunk.lookahead_block_ids = table.block_ids[cdiv(chunk.end, B):cdiv(table.num_tokens, B)]

    def verified(self, s: ScheduledSeq, res: StepResult) -> list[int] | None:
        """A speculating decode after verification: its KV is right up to the last accepted
        draft; the rest of its lookahead slots roll back (those past the kept tokens stay: the
        draft model wrote its next proposal's KV there this step)."""
        seq = s.seq
        seq.spec_tokens = res.drafts.get(seq.seq_id, [])  # for its next step
        if not seq.draft:
            return None
        accepted = res.accepted.get(seq.seq_id, [])
        ok = seq.seq_id in res.tokens
        drafted, seq.draft = len(seq.draft), []
        seq.num_computed_tokens = s.start + 1 + len(accepted)
        self.scheduler.kv.rollback(seq.seq_id, seq.num_computed_tokens, seq.token_ids + accepted,
                                   lookahead=self.lookahead(seq, seq.num_computed_tokens))
        if ok:
            self.stats.record(drafted, len(accepted))
        return accepted + ([res.tokens[seq.seq_id]] if ok else [])
