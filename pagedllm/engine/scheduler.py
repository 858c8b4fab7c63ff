"""Continuous batching: each step picks which tokens run, under a token budget, the
sequence cap and the KV pool; preempts by recompute when blocks run out."""
from __future__ import annotations

import itertools
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
        out = SchedulerOutput([], self.pending_copies)
        self.pending_copies = []
        budget, long_prefills = self._schedule_running(out)
        self._admit_waiting(out, budget, long_prefills)
        out.plan = self._plan(out)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> tuple[int, int]:
        """Running sequences first, oldest first; the newest are preempted to make room.
        Each decode later in the list keeps one token of budget: a prefill chunk never
        starves a decode. A beam group is one unit: planned, preempted and resumed whole.
        Returns the budget left and the long prefills under way."""
        budget = self.max_num_batched_tokens
        decodes_after = sum(1 for s in self.running if self._remaining(s) == 1)
        long_prefills = 0
        i = 0
        while i < len(self.running) and budget > 0:
            group = self._group(self.running, i)
            chunks: list[tuple[Sequence, int]] = []
            for seq in group:
                remaining = self._remaining(seq)
                if remaining == 1:
                    decodes_after -= 1
                    chunks.append((seq, 1))
                    continue
                long_prefills += remaining > self.long_prefill_token_threshold
                n = min(remaining, self.long_prefill_token_threshold,
                        budget - sum(k for _, k in chunks) - decodes_after)
                if n > 0:
                    chunks.append((seq, n))
            need = sum(self.kv.blocks_needed(s.seq_id, s.num_computed_tokens + n) for s, n in chunks)
            while chunks and need > self.kv.pool.num_free:
                victims = self._pop_last_group()
                decodes_after -= sum(1 for v in victims if self._remaining(v) == 1 and v not in group)
                self._preempt(victims, out)
                if group[0] in victims:
                    return budget, long_prefills
            for seq, n in chunks:
                copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)
                if copies is None:
                    raise RuntimeError(f"sequence {seq.seq_id}: {need} free blocks were counted but it did not fit")
                out.copies.extend(copies)
                self._add_scheduled(out, seq, n)
                budget -= n
            i += len(group)
        return budget, long_prefills

    def _admit_waiting(self, out: SchedulerOutput, budget: int, long_prefills: int) -> None:
        """Admit waiting sequences (a beam group whole), unless this step had to preempt
        (no room to spare). Samples of n > 1 and a beam group's future beams count against
        max_num_seqs from admission."""
        seats = len(self.running) + sum(self._pending_forks(s) for s in self.running) if self.waiting else 0
        skipped: list[Sequence] = []   # long prompts waiting for a partial-prefill slot
        while self.waiting and budget > 0 and not out.preempted:
            group = self._group(self.waiting, 0)
            need_seats = len(group) + self._pending_forks(group[0])
            if seats + need_seats > self.max_num_seqs and self.running:
                break
            chunks = []   # (seq, prefix hit, cached tokens, tokens to compute now)
            for j, seq in enumerate(group):
                hit = self.kv.lookup_prefix(seq.token_ids, seq.hashes)
                cached = len(hit) * self.kv.block_size
                share = (budget - sum(c[3] for c in chunks)) // (len(group) - j)
                chunks.append((seq, hit, cached, min(len(seq.token_ids) - cached, share,
                                                     self.long_prefill_token_threshold)))
            long = sum(len(s.token_ids) - c > self.long_prefill_token_threshold for s, _, c, _ in chunks)
            if len(group) == 1 and long and long_prefills >= self.max_num_partial_prefills:
                skipped.append(self.waiting.popleft())
                continue
            if any(n <= 0 for *_, n in chunks) or sum(
                    self.kv.blocks_needed(s.seq_id, c + n, hit) for s, hit, c, n in chunks) > self.kv.pool.num_free:
                break
            admitted = self._admit_group(chunks, out)
            budget -= admitted
            if not admitted:  # reserve-max: enough free blocks, but no contiguous run
                break
            long_prefills += long
            seats += need_seats
        self.waiting.extendleft(reversed(skipped))  # back at the front, in their order

    def _admit_group(self, chunks: list, out: SchedulerOutput) -> int:
        """Allocate and start each (seq, hit, cached, n) at the head of the queue; the
        tokens scheduled, or 0 if the first did not fit (only a single sequence can fail:
        beam groups run under the paged policy, where the counted blocks always fit).
        Every member takes its prefix hit before any takes fresh blocks: a fresh block
        may evict a cached-free one, which must not be a sibling's hit."""
        for i, (seq, hit, cached, _) in enumerate(chunks):
            if self.kv.allocate_slots(seq.seq_id, seq.token_ids, cached, hit, seq.hashes) is None:
                for earlier, *_ in chunks[:i]:  # reserve-max: free blocks, but no contiguous run
                    self.kv.free(earlier.seq_id)
                return 0
        scheduled = 0
        for seq, hit, cached, n in chunks:
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, cached + n)
            if copies is None:
                raise RuntimeError(f"sequence {seq.seq_id}: free blocks were counted but it did not fit")
            self.waiting.popleft()
            self._start(seq, cached)
            out.copies.extend(copies)
            self._add_scheduled(out, seq, n)
            scheduled += n
        return scheduled

    def _start(self, seq: Sequence, cached: int) -> None:
        if seq.num_output_tokens == 0 and seq.index == 0:
            seq.request.num_cached_tokens = cached
        if seq.request.scheduled_time is None:
            seq.request.scheduled_time = time.time()
        seq.num_computed_tokens = cached
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @staticmethod
    def _group(seqs, start: int) -> list[Sequence]:
        """The unit at `start`: a beam group's consecutive beams, else the sequence alone."""
        first = seqs[start]
        if first.request.beam is None:
            return [first]
        group = [first]
        for seq in itertools.islice(seqs, start + 1, None):
            if seq.request is not first.request:
                break
            group.append(seq)
        return group

    def _pop_last_group(self) -> list[Sequence]:
        group = [self.running.pop()]
        if group[0].request.beam is not None:
            while self.running and self.running[-1].request is group[0].request:
                group.append(self.running.pop())
        return group[::-1]

    def _plan(self, out: SchedulerOutput) -> StepPlan:
        chunks = []
        for s in out.scheduled:
            table = self.kv.block_table(s.seq.seq_id)
            end = s.start + s.num_tokens
            chunks.append(ChunkPlan(
                s.seq.seq_id, s.start, s.seq.token_ids[s.start:end], table.slots(s.start, end),
                table.block_ids[:cdiv(end, self.kv.block_size)],
                [SampleTarget(t.seq_id, t.params, t.seed, t.token_ids, t.num_prompt_tokens,
                              t.request.beam.num_candidates if t.request.beam else 0) for t in s.sample_for]))
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return StepPlan(chunks, out.copies, finished)

    @staticmethod
    def _remaining(seq: Sequence) -> int:
        return len(seq.token_ids) - seq.num_computed_tokens

    @staticmethod
    def _pending_forks(seq: Sequence) -> int:
        """Seats a unit will still take beyond its sequences: the samples of n > 1 not yet
        forked, or a beam group's beams to come (counted once, on its first live beam)."""
        req = seq.request
        if req.beam is not None:
            return req.beam.width - len(req.beams) if req.beams and req.beams[0] is seq else 0
        if seq.index != 0 or seq.num_output_tokens:
            return 0
        return sum(1 for c in req.seqs if c.status is SeqStatus.PENDING)

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

    def _preempt(self, seqs: list[Sequence], out: SchedulerOutput) -> None:
        """Preempt by recompute: drop their KV; they resume from the front of the queue,
        in their order (a beam group stays together)."""
        for seq in seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            self.num_preemptions += 1
            out.preempted.append(seq)
        self.waiting.extendleft(reversed(seqs))

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

    def fork_beam(self, parent: Sequence, child: Sequence) -> None:
        """A beam chosen twice: the child shares all of the parent's blocks (the partial
        last one is copied when either writes it) and runs right after its group, so a
        group stays one run of the running list."""
        child.hashes = parent.hashes.prefix(len(parent.token_ids))
        copies = self.kv.fork(parent.seq_id, child.seq_id, hashes=child.hashes)
        if copies is None:
            raise RuntimeError("beam search forks share blocks: it needs the paged policy")
        self.pending_copies.extend(copies)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SeqStatus.RUNNING
        last = max(i for i, s in enumerate(self.running) if s.request is parent.request)
        self.running.insert(last + 1, child)

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
