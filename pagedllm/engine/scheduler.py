"""Continuous batching: each step picks which tokens run, under a token budget, the
sequence cap and the KV pool; preempts by recompute when blocks run out."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv import KVCacheManager
from ..plan import ChunkPlan, SampleTarget, StepPlan
from ..util import cdiv
from .sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int            # first position computed this step
    num_tokens: int
    # Sequences to sample from this row's logits once the chunk reaches the end of the
    # sequence's tokens: [seq], or [parent, *pending samples] when n > 1 forks now.
    sample_for: list[Sequence] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]   # (src, dst) block copies to do before the forward
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    plan: StepPlan | None = None    # the same step in the runner's terms

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def auto_long_prefill_threshold(max_num_batched_tokens: int, block_size: int) -> int:
    """A quarter of the step budget, in whole blocks: a long prompt's chunk leaves three
    quarters of every step to decodes and to short prompts arriving behind it."""
    return max(block_size, max_num_batched_tokens // 4 // block_size * block_size)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A prompt with more uncomputed tokens than this is long: it is prefilled at most this
        # many tokens a step, and at most max_num_partial_prefills long ones at a time
        # (vLLM's knobs); shorter prompts are admitted past a long one that must wait.
        self.long_prefill_token_threshold = long_prefill_token_threshold or \
            auto_long_prefill_threshold(max_num_batched_tokens, kv.block_size)
        self.max_num_partial_prefills = max_num_partial_prefills
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.finished_seq_ids: list[int] = []   # since the last plan
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.hashes is None:  # its block keys, computed once however long it waits
            seq.hashes = self.kv.new_hashes(seq.request.cache_salt)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], self.pending_copies)
        self.pending_copies = []

        # Running sequences first, oldest first; the newest are preempted to make room.
        # Each decode later in the list keeps one token of budget: a prefill chunk never
        # starves a decode.
        decodes_after = sum(1 for s in self.running if self._remaining(s) == 1)
        long_prefills = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = self._remaining(seq)
            if remaining == 1:
                decodes_after -= 1
                n = 1
            else:
                long_prefills += remaining > self.long_prefill_token_threshold
                n = min(remaining, self.long_prefill_token_threshold, budget - decodes_after)
                if n <= 0:
                    i += 1
                    continue
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)
            while copies is None:
                victim = self.running.pop()
                if self._remaining(victim) == 1 and victim is not seq:
                    decodes_after -= 1
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)
            if copies is None:
                break
            out.copies.extend(copies)
            self._add_scheduled(out, seq, n)
            budget -= n
            i += 1

        # Then admit waiting ones, unless this step had to preempt (no room to spare).
        # Samples of n > 1 join at fork time; they count against max_num_seqs from admission.
        seats = len(self.running) + sum(self._pending_forks(s) for s in self.running) if self.waiting else 0
        skipped: list[Sequence] = []   # long prompts waiting for a partial-prefill slot
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            need = 1 + self._pending_forks(seq)
            if seats + need > self.max_num_seqs and self.running:
                break
            hit = self.kv.lookup_prefix(seq.token_ids, seq.hashes)
            cached = len(hit) * self.kv.block_size
            remaining = len(seq.token_ids) - cached
            long = remaining > self.long_prefill_token_threshold
            if long and long_prefills >= self.max_num_partial_prefills:
                skipped.append(self.waiting.popleft())
                continue
            n = min(remaining, budget, self.long_prefill_token_threshold)
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, cached + n, hit, seq.hashes)
            if copies is None:
                break
            self.waiting.popleft()
            long_prefills += long
            seats += need
            if seq.num_output_tokens == 0 and seq.index == 0:
                seq.request.num_cached_tokens = cached
            if seq.request.scheduled_time is None:
                seq.request.scheduled_time = time.time()
            seq.num_computed_tokens = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.copies.extend(copies)
            self._add_scheduled(out, seq, n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))  # back at the front, in their order
        out.plan = self._plan(out)
        return out

    def _plan(self, out: SchedulerOutput) -> StepPlan:
        chunks = []
        for s in out.scheduled:
            table = self.kv.block_table(s.seq.seq_id)
            end = s.start + s.num_tokens
            chunks.append(ChunkPlan(
                s.seq.seq_id, s.start, s.seq.token_ids[s.start:end], table.slots(s.start, end),
                table.block_ids[:cdiv(end, self.kv.block_size)],
                [SampleTarget(t.seq_id, t.params, t.seed, t.token_ids, t.num_prompt_tokens) for t in s.sample_for]))
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return StepPlan(chunks, out.copies, finished)

    @staticmethod
    def _remaining(seq: Sequence) -> int:
        return len(seq.token_ids) - seq.num_computed_tokens

    @staticmethod
    def _pending_forks(seq: Sequence) -> int:
        if seq.index != 0 or seq.num_output_tokens:
            return 0
        return sum(1 for c in seq.request.seqs if c.status is SeqStatus.PENDING)

    @staticmethod
    def _add_scheduled(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        s = ScheduledSeq(seq, seq.num_computed_tokens, n)
        if s.start + n == len(seq.token_ids):
            s.sample_for = [seq]
            if seq.index == 0 and seq.num_output_tokens == 0:
                s.sample_for += [c for c in seq.request.seqs[1:] if c.status is SeqStatus.PENDING]
        if n == 1 and seq.num_computed_tokens > 0:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n
        out.scheduled.append(s)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop its KV; it resumes from the front of the queue."""
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[tuple[Sequence, int]]:
        """Advance computed counts, fork pending samples, and return (seq, new token)."""
        new_tokens = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed_tokens = s.start + s.num_tokens
            for target in s.sample_for:
                if target.seq_id not in sampled:  # its sampling failed: the engine fails it
                    continue
                if target is not seq:
                    self._fork(seq, target)
                new_tokens.append((target, sampled[target.seq_id]))
        return new_tokens

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        child.token_ids = list(parent.token_ids)
        child.hashes = parent.hashes.prefix(len(child.token_ids))
        copies = self.kv.fork(parent.seq_id, child.seq_id, hashes=child.hashes)
        if copies is None:  # no room for a private copy (reserve-max): recompute it later
            child.num_computed_tokens = 0
            child.status = SeqStatus.WAITING
            self.waiting.appendleft(child)
            return
        self.pending_copies.extend(copies)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        self.finished_seq_ids.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
