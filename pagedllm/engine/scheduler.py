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
from .speculative import DraftModelProposer, NgramProposer, SpecStats


@dataclass
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


def auto_long_prefill_threshold(max_num_batched_tokens: int, block_size: int) -> int:
    """A quarter of the step budget, in whole blocks: a long prompt's chunk leaves three
    quarters of every step to decodes and to short prompts arriving behind it."""
    return max(block_size, max_num_batched_tokens // 4 // block_size * block_size)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1,
                 proposer: NgramProposer | DraftModelProposer | None = None, max_model_len: int = 1 << 62) -> None:
        self.kv = kv
        # Speculative decoding: a decode may carry draft tokens in lookahead slots.
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.spec = SpecStats()
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
                    room = budget - sum(k for _, k in chunks) - decodes_after - 1
                    chunks.append((seq, 1 + self._draft(seq, room)))
                    continue
                long_prefills += remaining > self.long_prefill_token_threshold
                n = min(remaining, self.long_prefill_token_threshold,
                        budget - sum(k for _, k in chunks) - decodes_after)
                if n > 0:
                    chunks.append((seq, n))
            while (copies := self._allocate_unit(chunks)) is None:
                if any(s.draft for s, _ in chunks):  # drop the drafts before preempting anyone
                    chunks = [(s, n - len(s.draft)) for s, n in chunks]
                    for s, _ in chunks:
                        s.draft = []
                    continue
                victims = self._pop_last_group()
                decodes_after -= sum(1 for v in victims if self._remaining(v) == 1 and v not in group)
                self._preempt(victims, out)
                if group[0] in victims:
                    return budget, long_prefills
            out.copies.extend(copies)
            for seq, n in chunks:
                self._add_scheduled(out, seq, n)
                budget -= n
            i += len(group)
        return budget, long_prefills

    def _allocate_unit(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[int, int]] | None:
        """Slots for a running unit's chunks, or None with nothing changed. A sequence alone
        just asks (once per decode); a beam group counts its blocks first, all or none."""
        if len(chunks) > 1 and sum(self.kv.blocks_needed(s.seq_id, s.num_computed_tokens + n)
                                   for s, n in chunks) > self.kv.pool.num_available:
            return None
        copies: list[tuple[int, int]] = []
        for seq, n in chunks:
            more = self.kv.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n,
                                          lookahead=len(seq.draft))
            if more is None:
                if len(chunks) > 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: its group's blocks were counted but it did not fit")
                return None
            copies += more
        return copies

    def _draft(self, seq: Sequence, room: int) -> int:
        """Draft tokens for a decode (seq.draft), within `room` tokens of step budget, the
        request's max_tokens and max_model_len. Beams and requests that ask for logprobs
        decode one token a step."""
        seq.draft = []
        p = seq.params
        if self.proposer is None or seq.request.beam is not None or p.logprobs is not None or p.ranks_samples:
            return 0
        if self.proposer.disable_by_batch_size and len(self.running) >= self.proposer.disable_by_batch_size:
            return 0
        limit = min(room, seq.request.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - len(seq.token_ids) - 1)
        if limit <= 0:
            return 0
        if seq.ngrams is None:
            seq.ngrams = self.proposer.new_index()
        seq.draft = self.proposer.propose(seq.ngrams, seq.token_ids, limit)
        return len(seq.draft)

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
                # Prompt logprobs need every prompt row computed: no prefix hit for them.
                hit = [] if seq.request.prompt_logprobs is not None else \
                    self.kv.lookup_prefix(seq.token_ids, seq.hashes)
                cached = len(hit) * self.kv.block_size
                share = (budget - sum(c[3] for c in chunks)) // (len(group) - j)
                chunks.append((seq, hit, cached, min(len(seq.token_ids) - cached, share,
                                                     self.long_prefill_token_threshold)))
            long = sum(len(s.token_ids) - c > self.long_prefill_token_threshold for s, _, c, _ in chunks)
            if len(group) == 1 and long and long_prefills >= self.max_num_partial_prefills:
                skipped.append(self.waiting.popleft())
                continue
            if any(n <= 0 for *_, n in chunks) or len(group) > 1 and sum(
                    self.kv.blocks_needed(s.seq_id, c + n, hit) for s, hit, c, n in chunks) > self.kv.pool.num_available:
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
        tokens scheduled, or 0 if a sequence alone did not fit (a beam group's blocks were
        counted, and beams run under the paged policy, where counted blocks always fit).
        A group's members take their prefix hits before any takes fresh blocks: a fresh
        block may evict a cached-free one, which must not be a sibling's hit."""
        if len(chunks) > 1:
            for seq, hit, cached, _ in chunks:
                self.kv.allocate_slots(seq.seq_id, seq.token_ids, cached, hit, seq.hashes)
        scheduled = 0
        for seq, hit, cached, n in chunks:
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, cached + n, hit, seq.hashes)
            if copies is None:
                if len(chunks) > 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: its group's blocks were counted but it did not fit")
                return 0  # reserve-max: free blocks, but no contiguous run
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
            draft = s.seq.draft
            chunks.append(ChunkPlan(
                s.seq.seq_id, s.start, s.seq.token_ids[s.start:end - len(draft)] + draft, table.slots(s.start, end),
                table.block_ids[:cdiv(end, self.kv.block_size)],
                [SampleTarget(t.seq_id, t.params, t.seed, t.token_ids, t.num_prompt_tokens,
                              t.request.beam.num_candidates if t.request.beam else 0) for t in s.sample_for],
                list(draft)))
            if draft and self.proposer.runner_drafts:
                chunks[-1].draft_from, chunks[-1].context = s.seq.draft_done, s.seq.token_ids
            self._plan_scores(chunks[-1], s.seq)
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return StepPlan(chunks, out.copies, finished)

    @staticmethod
    def _plan_scores(chunk: ChunkPlan, seq: Sequence) -> None:
        """The prompt tokens this chunk's rows score, those not scored yet (a recompute after
        preemption scores nothing twice)."""
        got = seq.request.prompt_logprobs
        if got is None or seq.index != 0:
            return
        first, last = max(chunk.start, len(got) - 1), min(chunk.end, seq.num_prompt_tokens - 1)
        if first < last:
            chunk.score_start, chunk.score_ids = first, seq.token_ids[first + 1:last + 1]
            chunk.score_top = seq.params.prompt_logprobs

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

    def _preempt(self, seqs: list[Sequence], out: SchedulerOutput) -> None:
        """Preempt by recompute: drop their KV; they resume from the front of the queue,
        in their order (a beam group stays together)."""
        for seq in seqs:
            self.kv.free(seq.seq_id)
            seq.draft = []
            seq.draft_done = 0
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            self.num_preemptions += 1
            out.preempted.append(seq)
        self.waiting.extendleft(reversed(seqs))

    def update(self, out: SchedulerOutput, sampled: dict[int, int], accepted: dict[int, list[int]] | None = None
               ) -> list[tuple[Sequence, int]]:
        """Advance computed counts, fork pending samples, and return (seq, new token), a
        sequence's accepted draft tokens first, in order, then the token it sampled. The
        lookahead slots of rejected drafts go back to the KV manager."""
        new_tokens = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            if seq.draft:
                new_tokens += self._verified(s, (accepted or {}).get(seq.seq_id, []), seq.seq_id in sampled)
                if seq.seq_id in sampled:
                    new_tokens.append((seq, sampled[seq.seq_id]))
                continue
            seq.num_computed_tokens = s.start + s.num_tokens
            for target in s.sample_for:
                if target.seq_id not in sampled:  # its sampling failed: the engine fails it
                    continue
                if target is not seq:
                    target.token_ids = list(seq.token_ids)
                    self.fork(seq, target)
                new_tokens.append((target, sampled[target.seq_id]))
        return new_tokens

    def _verified(self, s: ScheduledSeq, accepted: list[int], ok: bool) -> list[tuple[Sequence, int]]:
        """A speculating decode after verification: its KV is right up to the last accepted
        draft; the rest of its lookahead slots roll back."""
        seq = s.seq
        drafted, seq.draft = len(seq.draft), []
        seq.num_computed_tokens = s.start + 1 + len(accepted)
        if self.proposer.runner_drafts:  # the draft model saw the real token and all but its last draft
            seq.draft_done = s.start + 1 + min(len(accepted), drafted - 1)
        self.kv.rollback(seq.seq_id, seq.num_computed_tokens, seq.token_ids + accepted)
        if ok:
            self.spec.record(drafted, len(accepted))
        return [(seq, t) for t in accepted]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (its tokens set: the parent's, or a beam's one token more) shares the
        parent's blocks. A sample of n > 1 joins the end of the running list; a beam runs
        right after its group, so a group stays one run of the list. Under reserve-max the
        child's private copy may not fit: it is recomputed later (beams need paged)."""
        child.hashes = parent.hashes.prefix(len(parent.token_ids))
        copies = self.kv.fork(parent.seq_id, child.seq_id, hashes=child.hashes)
        if copies is None:
            child.num_computed_tokens = 0
            child.status = SeqStatus.WAITING
            self.waiting.appendleft(child)
            return
        self.pending_copies.extend(copies)
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
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        self.finished_seq_ids.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
