"""Continuous batching: each step picks which tokens run, under a token budget, the sequence
cap and the KV pool; preempts by recompute when blocks run out.

Batching only: running sequences first (each decode keeps a token of budget, long prompts
are chunked), then the waiting ones the queue policy puts first (admission.py), then the
plan in the runner's terms. Features that take part in a step (speculation, prompt-score
caching, tier loads, beams) join through StepHooks; stops and the step's results are
applied by step_update.StepApplier."""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Sequence as Seq

from ..kv import KVCacheManager
from ..plan import ChunkPlan, SampleTarget, StepPlan
from ..util import cdiv
from .admission import admit_waiting
from .hooks import StepHook
from .queue_policy import QueuePolicy, make_policy, unit_at
from .sequence import Request, Sequence, SeqStatus
from .step_types import Counters, ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)


def auto_long_prefill_threshold(max_num_batched_tokens: int, block_size: int) -> int:
    """A quarter of the step budget, in whole blocks: a long prompt's chunk leaves three
    quarters of every step to decodes and to short prompts arriving behind it."""
    return max(block_size, max_num_batched_tokens // 4 // block_size * block_size)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1,
                 max_model_len: int = 1 << 62, policy: QueuePolicy | str = "fcfs",
                 hooks: Seq[StepHook] = ()) -> None:
        """policy: the queue policy (queue_policy: fcfs, lpm, priority) or its name.
        hooks: the features that join each step, in the order they are asked."""
        self.kv = kv
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
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
        self.counters = Counters()
        self._seq_ids = itertools.count()
        self.hooks: list[StepHook] = []
        for hook in hooks:
            self.add_hook(hook)

    def add_hook(self, hook: StepHook) -> None:
        hook.bind(self)
        self.hooks.append(hook)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, seq: Sequence) -> None:
        if seq.hashes is None:  # its block keys, computed once however long it waits
            seq.hashes = self.kv.new_hashes(seq.request.block_salt)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_preemptions(self) -> int:
        return self.counters.preemptions

    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        for hook in self.hooks:
            hook.begin_step()
        out = SchedulerOutput([], self.pending_copies)
        self.pending_copies = []
        budget, long_prefills = self._schedule_running(out)
        if not out.preempted:  # a step that had to preempt has no room to spare
            admit_waiting(self, out, budget, long_prefills)
        out.plan = self._plan(out)
        out.plan.saves, out.plan.loads, out.plan.writes = self.kv.take_io()
        for hook in self.hooks:
            hook.planned(out.plan)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> tuple[int, int]:
        """Running sequences first, oldest first; the queue policy's victim is preempted to
        make room. Each decode later in the list keeps one token of budget: a prefill chunk
        never starves a decode. A beam group is one unit: planned, preempted and resumed
        whole. Returns the budget left and the long prefills under way."""
        budget = self.max_num_batched_tokens
        self.policy.arrange(self.running)
        decodes_after = sum(1 for s in self.running if self.remaining(s) == 1)
        long_prefills = 0
        i = 0
        while i < len(self.running) and budget > 0:
            group = unit_at(self.running, i)
            chunks: list[tuple[Sequence, int]] = []
            for seq in group:
                remaining = self.remaining(seq)
                if remaining == 1:
                    decodes_after -= 1
                    room = budget - sum(k for _, k in chunks) - decodes_after - 1
                    chunks.append((seq, 1 + sum(h.decode_extra(seq, room) for h in self.hooks)))
                    continue
                long_prefills += remaining > self.long_prefill_token_threshold
                n = min(remaining, self.long_prefill_token_threshold, budget - sum(k for _, k in chunks) - decodes_after)
                if n > 0:
                    chunks.append((seq, n))
            while (copies := self._allocate_unit(chunks)) is None:
                dropped = [sum(h.drop_extra(s) for h in self.hooks) for s, _ in chunks]
                if any(dropped):  # the drafts go before anyone is preempted
                    chunks = [(s, n - d) for (s, n), d in zip(chunks, dropped)]
                    continue
                victims = self._pop_last_unit()
                decodes_after -= sum(1 for v in victims if self.remaining(v) == 1 and v not in group)
                self.preempt(victims, out)
                if group[0] in victims:
                    return budget, long_prefills
            out.copies.extend(copies)
            for seq, n in chunks:
                self.add_scheduled(out, seq, n)
                budget -= n
            i += len(group)
        return budget, long_prefills

    def _pop_last_unit(self) -> list[Sequence]:
        """The running list's last unit, taken off it (a beam group whole)."""
        unit = [self.running.pop()]
        while unit[0].request.beam is not None and self.running and self.running[-1].request is unit[0].request:
            unit.insert(0, self.running.pop())
        return unit

    def _allocate_unit(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[int, int]] | None:
        """Slots for a running unit's chunks, or None with nothing changed. A sequence alone
        just asks (once per decode); a beam group counts its blocks first, all or none."""
        if len(chunks) > 1 and sum(self.kv.blocks_needed(s.seq_id, max(s.num_computed_tokens + n, s.reread_until))
                                   for s, n in chunks) > self.kv.pool.num_available:
            return None
        copies: list[tuple[int, int]] = []
        for seq, n in chunks:
            end = max(seq.num_computed_tokens + n, seq.reread_until)
            ahead = self.lookahead(seq, end)
            more = self.kv.allocate_slots(seq.seq_id, seq.token_ids, end + ahead, lookahead=len(seq.draft) + ahead,
                                          first_query=seq.num_computed_tokens)
            if more is None:
                if len(chunks) > 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: its group's blocks were counted but it did not fit")
                return None
            copies += more
        return copies

    def lookahead(self, seq: Sequence, end: int) -> int:
        return max((h.lookahead(seq, end) for h in self.hooks), default=0)

    def hold(self, seq: Sequence) -> bool:
        """A sequence about to run takes what its hooks keep in the pool for it (an adapter's
        pages); False, changing nothing, if the pool has no room for them."""
        for i, hook in enumerate(self.hooks):
            if not hook.hold(seq):
                for held in self.hooks[:i]:
                    held.drop(seq)
                return False
        return True

    def drop(self, seq: Sequence) -> None:
        """A sequence stops running: what its hooks held for it goes back."""
        for hook in self.hooks:
            hook.drop(seq)

    def extra_blocks(self, seq: Sequence) -> int:
        """Blocks hold(seq) would take beyond its KV."""
        return sum(h.extra_blocks(seq) for h in self.hooks)

    def start(self, seq: Sequence, start: int, cached: int) -> None:
        """A waiting sequence admitted: it runs from `start`; `cached` prompt tokens came from the prefix cache."""
        req = seq.request
        if seq.num_output_tokens == 0 and seq.index == 0:
            req.num_cached_tokens = cached
        if req.scheduled_time is None:
            req.scheduled_time = time.time()
        seq.num_computed_tokens = start
        seq.reread_until = cached if start < cached else 0
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        for hook in self.hooks:
            hook.admitted(seq)

    @staticmethod
    def remaining(seq: Sequence) -> int:
        return len(seq.token_ids) - seq.num_computed_tokens

    @staticmethod
    def add_scheduled(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        d = len(seq.draft)
        s = ScheduledSeq(seq, seq.num_computed_tokens, n, num_draft=d)
        if s.start + n - d == len(seq.token_ids):
            s.sample_for = [seq]
            if seq.index == 0 and seq.num_output_tokens == 0:
                s.sample_for += [c for c in seq.request.seqs[1:] if c.status is SeqStatus.PENDING]
        if n - d == 1 and seq.num_computed_tokens > 0:
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n
        out.scheduled.append(s)

    def preempt(self, seqs: list[Sequence], out: SchedulerOutput) -> None:
        """Preempt (taken off the running list): drop their KV; they resume from the front of
        the queue, in their order (a beam group stays together), through a prefix hit of what
        the pool and the tier kept."""
        for seq in seqs:
            for hook in self.hooks:
                hook.preempted(seq)
            self.kv.free(seq.seq_id)
            self.drop(seq)
            seq.num_computed_tokens = 0
            seq.reread_until = 0
            seq.status = SeqStatus.WAITING
            self.counters.preemptions += 1
            out.preempted.append(seq)
        self.waiting.extendleft(reversed(seqs))

    def _plan(self, out: SchedulerOutput) -> StepPlan:
        chunks = []
        B = self.kv.block_size
        for s in out.scheduled:
            seq, end = s.seq, s.start + s.num_tokens
            tables = [g.tables[seq.seq_id] for g in self.kv.groups]
            reread = min(end, seq.reread_until) - s.start
            slots = [t.slots(s.start, end) for t in tables]
            if reread > 0:  # their KV is a prefix hit's: read, never written over
                for sl in slots:
                    sl[:reread] = [-1] * reread
            chunk = ChunkPlan(
                seq.seq_id, s.start, seq.token_ids[s.start:end - len(seq.draft)] + seq.draft, slots[0],
                tables[0].block_ids[:cdiv(end, B)],
                [SampleTarget(t.seq_id, t.params, t.seed, t.token_ids, t.num_prompt_tokens,
                              t.request.beam.num_candidates if t.request.beam else 0, 0, t.request.grammar,
                              t.grammar_from() if t.request.grammar is not None else 0)
                 for t in s.sample_for], list(seq.draft))
            if len(tables) > 1:
                chunk.groups = [(sl, t.block_ids[:cdiv(end, B)]) for sl, t in zip(slots[1:], tables[1:])]
            for hook in self.hooks:
                hook.plan(chunk, s)
            chunks.append(chunk)
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return StepPlan(chunks, out.copies, finished)

    # -- sequences that fork and end -------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (its tokens set: the parent's, or a beam's one token more) shares the
        parent's blocks. A sample of n > 1 joins the end of the running list; a beam runs
        right after its group, so a group stays one run of the list. Under reserve-max the
        child's private copy may not fit: it is recomputed later (beams need paged)."""
        child.hashes = parent.hashes.prefix(len(parent.token_ids))
        # The computed tokens only: the parent's lookahead slots are its own.
        copies = self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens, hashes=child.hashes)
        if copies is None:
            child.num_computed_tokens = 0
            child.status = SeqStatus.WAITING
            self.waiting.appendleft(child)
            return
        self.pending_copies.extend(copies)
        held = self.hold(child)   # what its parent holds, held once more: nothing to place
        assert held
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SeqStatus.RUNNING
        if child.request.beam is None:
            self.running.append(child)
        else:
            last = max(i for i, s in enumerate(self.running) if s.request is parent.request)
            self.running.insert(last + 1, child)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.drop(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        self.finished_seq_ids.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def fail(self, req: Request, error: str, invalid: bool = False) -> None:
        """Something went wrong for this request alone inside a step: end it (its blocks
        go back now) and let the rest of the batch go on. invalid: the request's own
        parameters caused it (a client error)."""
        logger.warning("request %s failed inside a step: %s", req.request_id, error)
        req.error, req.error_invalid = error, invalid
        for seq in req.seqs:
            if seq.status is SeqStatus.PENDING:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
            else:
                self.finish(seq, "error")

