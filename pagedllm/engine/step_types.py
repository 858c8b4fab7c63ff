"""What a step's parts hand each other, as plain data: what the scheduler admitted and ran,
why a waiting request did not start, what a step changed, and the engine's counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

from ..plan import StepPlan
from .sequence import Request, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int            # first position computed this step
    num_tokens: int
    # Sequences to sample from this row's logits once the chunk reaches the end of the
    # sequence's tokens: [seq], or [parent, *pending samples] when n > 1 forks now.
    sample_for: list[Sequence] = field(default_factory=list)
    num_draft: int = 0    # of num_tokens, the draft tokens (speculative decoding) verified


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]   # (src, dst) block copies to do before the forward
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0      # a decode's draft tokens included
    preempted: list[Sequence] = field(default_factory=list)
    plan: StepPlan | None = None    # the same step in the runner's terms

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class StepUpdate:
    """What one step changed, for the output processor and the observers."""
    out: SchedulerOutput
    new_tokens: list[tuple[Sequence, int]] = field(default_factory=list)  # in order
    touched: dict[str, Request] = field(default_factory=dict)            # requests the step moved
    now: float = 0.0                                                     # when its result was applied


@dataclass(slots=True)
class AdmitChunk:
    """A waiting sequence that starts this step: its prefix hit (blocks per group), where its
    computing starts, and how many tokens it computes now."""
    seq: Sequence
    hit: Seq[int]
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Why a waiting unit does not start this step. `holds_queue`: nobody behind it may pass
    (it waits for room that anyone else would take first); else it steps aside."""
    reason: str
    holds_queue: bool = False


# The reasons, named once (tests and logs compare them).
COMPILING = Wait("grammar compiling")
NO_SEATS = Wait("max_num_seqs reached", True)
NO_BUDGET = Wait("step's token budget spent", True)
NO_BLOCKS = Wait("too few free KV blocks", True)
PARTIAL_PREFILLS = Wait("max_num_partial_prefills long prompts under way")


@dataclass(slots=True)
class Counters:
    """The engine's running totals (EngineStats takes them as they are)."""
    preemptions: int = 0
    prompt_tokens: int = 0            # prompt tokens of requests that started generating
    computed_prompt_tokens: int = 0   # prefill tokens actually run (cache hits skip, recompute repeats)
    generation_tokens: int = 0
    steps: int = 0
