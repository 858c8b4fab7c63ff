"""How a feature joins a step without the scheduler knowing its internals.

The scheduler batches: it admits, chunks, budgets, preempts and plans. Features that take
part in a step (speculative decoding, prompt logprobs kept with cached blocks, the KV tier's
loads, beam search, LoRA adapters) each implement the few StepHook points they need and keep their state
to themselves; every method's default does nothing. The scheduler calls its hooks in order
at each point. Prompt scoring and beams are always registered (any request may ask for
them); the tier's loads and speculation only when the engine has them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan import ChunkPlan, StepPlan, StepResult

if TYPE_CHECKING:
    from ..kv.prefix_hit import PrefixHit
    from .sequence import Sequence
    from .step_types import ScheduledSeq, SchedulerOutput, StepUpdate, Wait


class StepHook:
    """A feature's part in each step."""

    def bind(self, scheduler) -> None:
        """The scheduler.Scheduler this hook serves (read its queues; change them only through it)."""
        self.scheduler = scheduler

    # -- scheduling ----------------------------------------------------------
    def begin_step(self) -> None:
        """Before anything is scheduled."""

    def admit(self, seq: Sequence, hit: PrefixHit, start: int, alone: bool) -> tuple[PrefixHit, int] | Wait:
        """A waiting sequence's prefix hit and first computed position, as this hook would
        have them (`alone`: not part of a beam group admitted whole), or why it waits."""
        return hit, start

    def admitted(self, seq: Sequence) -> None:
        """A waiting sequence started running this step."""

    def extra_blocks(self, seq: Sequence) -> int:
        """Pool blocks a waiting sequence's hold() would take beyond its KV (counted with a
        group's blocks before any is allocated)."""
        return 0

    def hold(self, seq: Sequence) -> bool:
        """A sequence about to run (admitted, or forked off one running) takes what this hook
        keeps in the pool for it; False, changing nothing, if the pool lacks the room."""
        return True

    def drop(self, seq: Sequence) -> None:
        """A sequence that held stops running (preempted, finished, or it did not fit after all)."""

    def decode_extra(self, seq: Sequence, room: int) -> int:
        """Tokens a decode carries beyond its one (draft tokens), within `room` of budget."""
        return 0

    def drop_extra(self, seq: Sequence) -> int:
        """The pool is short: take back a decode's extra tokens; how many went."""
        return 0

    def lookahead(self, seq: Sequence, end: int) -> int:
        """Slots to hold past a sequence's `end` (a draft model's next proposal)."""
        return 0

    def preempted(self, seq: Sequence) -> None:
        """A running sequence is about to lose its KV (preemption)."""

    def plan(self, chunk: ChunkPlan, s: ScheduledSeq) -> None:
        """Fill this hook's part of a chunk of the runner's plan."""

    def planned(self, plan: StepPlan) -> None:
        """Fill this hook's part of the whole step's plan (after every chunk's)."""

    # -- after the forward ---------------------------------------------------
    def verified(self, s: ScheduledSeq, res: StepResult) -> list[int] | None:
        """The tokens a row yields when this hook decides them (a decode's accepted drafts
        and the token after), its computed count set; None: not this hook's row."""
        return None

    def after_step(self, out: SchedulerOutput, res: StepResult, up: StepUpdate) -> None:
        """Apply this hook's part of a step's result (after every row's tokens)."""
