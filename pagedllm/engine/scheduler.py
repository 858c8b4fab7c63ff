"""Continuous batching: each step picks which tokens run, under a token budget, the
sequence cap and the KV pool; preempts by recompute when blocks run out."""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import PREEMPTION_MODES, SCHEDULING_POLICIES
from ..kv import KVCacheManager
from ..plan import ChunkPlan, PromptScores, SampleTarget, StepPlan, StepResult
from ..util import cdiv
from .sequence import Request, Sequence, SeqStatus
from .speculative import SpecPolicy, SpecStats

logger = logging.getLogger(__name__)


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


@dataclass
class StepUpdate:
    """What one step changed, for the output processor and the observers."""
    out: SchedulerOutput
    new_tokens: list[tuple[Sequence, int]] = field(default_factory=list)  # in order
    touched: dict[str, Request] = field(default_factory=dict)            # requests the step moved


# Longest-prefix-match ordering looks every waiting request up each step: past this many
# waiting it costs more than it wins, and admission is first come, first served (SGLang's rule).
LPM_MAX_WAITING = 128


def auto_long_prefill_threshold(max_num_batched_tokens: int, block_size: int) -> int:
    """A quarter of the step budget, in whole blocks: a long prompt's chunk leaves three
    quarters of every step to decodes and to short prompts arriving behind it."""
    return max(block_size, max_num_batched_tokens // 4 // block_size * block_size)


class _Scoring:
    """The keys of the prompt blocks whose logprobs running sequences will keep once computed,
    built on first use in a step's admission and grown as it admits."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self._keys: set[int] | None = None

    def keys(self) -> set[int]:
        if self._keys is None:
            self._keys = set()
            for seq in self.sched.running:
                self.started(seq)
        return self._keys

    def started(self, seq: Sequence) -> None:
        if self._keys is not None and self.sched._keeps_scores(seq):
            B = self.sched.kv.block_size
            self._keys.update(seq.hashes.keys[self.sched._scored_blocks(seq):seq.num_prompt_tokens // B])


_NO_ROOM, _LATER = object(), object()   # a tier hit that waits: for blocks; for the next step's loads


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1,
                 spec_policy: SpecPolicy | None = None, max_model_len: int = 1 << 62,
                 eos_token_ids: frozenset[int] = frozenset(), max_logprobs: int = 20,
                 preemption_mode: str = "recompute", policy: str = "fcfs", aging_bound: float = 2.0) -> None:
        """preemption_mode: recompute drops a victim's KV (a resume takes what the prefix
        cache still has); swap first saves its full blocks to the KV manager's tier.
        policy: fcfs admits in arrival order; lpm prefers the waiting requests with the
        longest prefix in the pool or the tier, except that the oldest waiting request, once
        it has been the oldest for `aging_bound` seconds, goes ahead of every younger one."""
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and kv.tier is None:
            raise ValueError("preemption_mode swap saves a preempted sequence's blocks to the second tier: "
                             "set kv_offload_dir (--kv-offload-dir) too")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        if not aging_bound >= 0:
            raise ValueError(f"scheduling_aging_bound must be >= 0 seconds, got {aging_bound!r}")
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.aging_bound = aging_bound
        self._load_budget, self._loaded = 0, False   # this step's tier loads (set by schedule())
        self.kv = kv
        # Prompt logprobs are scored at this top k when the prefix cache keeps them beside
        # its blocks (every later request must find its k there), else at each request's.
        self.max_logprobs = max_logprobs
        self.eos_token_ids = eos_token_ids
        # Speculative decoding: a decode may carry the draft tokens the runtime proposed
        # after its last step, in lookahead slots.
        self.spec_policy = spec_policy
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
        self._seq_ids = itertools.count()
        # The step's counters (the engine reports them): prompt tokens of requests that
        # started generating, prefill tokens actually run, generated tokens, steps.
        self.prompt_tokens = 0
        self.computed_prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def prompt_scores_for(self, k: int) -> PromptScores:
        """Empty prompt scores for a request asking the top k, at the k it will be scored at."""
        return PromptScores(self.max_logprobs if self.kv.enable_prefix_caching else k)

    def add(self, seq: Sequence) -> None:
        if seq.hashes is None:  # its block keys, computed once however long it waits
            seq.hashes = self.kv.new_hashes(seq.request.cache_salt)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        out = SchedulerOutput([], self.pending_copies)
        self.pending_copies = []
        # Blocks a step may read from the tier: a step's token budget of them, but the first
        # request with a tier hit loads its whole hit (never recomputes what it could load).
        self._load_budget, self._loaded = cdiv(self.max_num_batched_tokens, self.kv.block_size), False
        budget, long_prefills = self._schedule_running(out)
        self._admit_waiting(out, budget, long_prefills)
        out.plan = self._plan(out)
        out.plan.saves, out.plan.loads, out.plan.writes = self.kv.take_tier_io()
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
        if len(chunks) > 1 and sum(self.kv.blocks_needed(s.seq_id, max(s.num_computed_tokens + n, s.reread_until))
                                   for s, n in chunks) > self.kv.pool.num_available:
            return None
        copies: list[tuple[int, int]] = []
        for seq, n in chunks:
            end = max(seq.num_computed_tokens + n, seq.reread_until)
            ahead = self._lookahead(seq, end)
            more = self.kv.allocate_slots(seq.seq_id, seq.token_ids, end + ahead, lookahead=len(seq.draft) + ahead,
                                          first_query=seq.num_computed_tokens)
            if more is None:
                if len(chunks) > 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: its group's blocks were counted but it did not fit")
                return None
            copies += more
        return copies

    def _draft(self, seq: Sequence, room: int) -> int:
        """Draft tokens for a decode (seq.draft): what the runtime proposed after its last
        step, within `room` tokens of step budget, the request's max_tokens and max_model_len."""
        seq.draft = []
        if not seq.spec_tokens or not self._speculates(seq):
            return 0
        limit = min(room, self.tokens_left(seq.request, seq.num_output_tokens) - 1)
        if limit <= 0:
            return 0
        seq.draft = seq.spec_tokens[:limit]
        return len(seq.draft)

    def _speculates(self, seq: Sequence) -> bool:
        """Whether a sequence drafts this step. Beams and requests that ask for logprobs (or
        rank samples by them) decode one token a step; so does everyone in a batch of at
        least disable_by_batch_size sequences."""
        policy, p = self.spec_policy, seq.params
        if policy is None or seq.request.beam is not None or p.logprobs is not None or p.ranks_samples:
            return False
        return not (policy.disable_by_batch_size and len(self.running) >= policy.disable_by_batch_size)

    def _lookahead(self, seq: Sequence, end: int) -> int:
        """Slots to hold past `end` for a draft model's next proposal (never past max_model_len;
        beams never draft). Held by every such sequence whether it drafts this step or not,
        so what a table holds only grows between steps."""
        if self.spec_policy is None or seq.request.beam is not None:
            return 0
        return max(0, min(self.spec_policy.num_lookahead_tokens, self.max_model_len - end))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, long_prefills: int) -> None:
        """Admit waiting sequences (a beam group whole), unless this step had to preempt
        (no room to spare). Samples of n > 1 and a beam group's future beams count against
        max_num_seqs from admission."""
        seats = len(self.running) + sum(self._pending_forks(s) for s in self.running) if self.waiting else 0
        skipped: list[Sequence] = []   # long prompts waiting for a partial-prefill slot,
        # prompt-logprob requests waiting for logprobs a running request is computing, and
        # requests whose grammar is compiling
        scoring = _Scoring(self)
        if self.policy == "lpm" and not out.preempted:
            self._order_waiting()
        while self.waiting and budget > 0 and not out.preempted:
            group = self._group(self.waiting, 0)
            if group[0].request.compiling is not None:  # its grammar is not compiled yet
                skipped.append(self.waiting.popleft())
                continue
            need_seats = len(group) + self._pending_forks(group[0])
            if seats + need_seats > self.max_num_seqs and self.running:
                break
            chunks = []   # (seq, prefix hit, first position computed, tokens to compute now)
            for j, seq in enumerate(group):
                hit = self.kv.lookup_prefix(seq.token_ids, seq.hashes)
                if self.kv.tier is not None and len(group) == 1:
                    hit = self._tier_hit(seq, hit)
                    if not isinstance(hit, list):
                        break
                start = self._first_row(seq, hit, scoring if len(group) == 1 else None)
                if start is None:
                    break
                if start < len(hit) * self.kv.block_size and self.kv.sliding_window:
                    # Rows re-read over a hit need the keys of their own windows, which a
                    # window hit may lack: under a sliding window they are recomputed.
                    hit = self.kv.shorten_hit(hit, start // self.kv.block_size)
                    start = len(hit) * self.kv.block_size
                share = (budget - sum(c[3] for c in chunks)) // (len(group) - j)
                chunks.append((seq, hit, start, min(len(seq.token_ids) - start, share,
                                                    self.long_prefill_token_threshold)))
            if hit is _NO_ROOM:  # its tier hit waits for blocks: nobody passes it
                break
            if len(chunks) < len(group):  # its logprobs come from the cache next step (or its tier
                skipped.append(self.waiting.popleft())  # hit from the next step's loads), not computed now
                continue
            long = sum(len(s.token_ids) - c > self.long_prefill_token_threshold for s, _, c, _ in chunks)
            if len(group) == 1 and long and long_prefills >= self.max_num_partial_prefills:
                skipped.append(self.waiting.popleft())
                continue
            if any(n <= 0 for *_, n in chunks) or len(group) > 1 and sum(
                    self.kv.blocks_needed(s.seq_id, self._kv_end(hit, c + n), hit)
                    for s, hit, c, n in chunks) > self.kv.pool.num_available:
                break
            admitted = self._admit_group(chunks, out)
            budget -= admitted
            if not admitted:  # reserve-max: enough free blocks, but no contiguous run
                break
            long_prefills += long
            seats += need_seats
            scoring.started(group[0])
        self.waiting.extendleft(reversed(skipped))  # back at the front, in their order

    def _tier_hit(self, seq: Sequence, hit: list[int]) -> list[int] | object:
        """The pool hit extended by the blocks loaded from the tier. A load takes the whole
        hit's blocks at once (computing it would take them a chunk a step), so it waits until
        they fit beside the prompt's first chunk with a block to spare for each running
        sequence (_NO_ROOM: nobody passes it); without the spare blocks, the next step
        preempts the newest sequence, often this one, which comes back the same way: a thrash
        measured at 14x the preemptions of recompute. With nothing running it loads what
        fits. _LATER when this step's loads are spent (the first tier hit of a step loads whole)."""
        kv, B = self.kv, self.kv.block_size
        n = kv.tier_prefix(seq.hashes, len(seq.token_ids), hit)
        if not n:
            return hit
        if self._loaded and n > self._load_budget:
            return _LATER
        rest = len(seq.token_ids) - (len(hit) + n) * B
        room = kv.pool.num_available - sum(1 for b in hit if kv.pool.is_available(b)) - \
            cdiv(min(rest, self.long_prefill_token_threshold), B) - 1
        if self.running and n > room - len(self.running):
            return _NO_ROOM
        got = kv.load_from_tier(seq.seq_id, seq.hashes, len(seq.token_ids), hit, max(0, min(n, room)))
        self._loaded = True
        self._load_budget -= len(got) - len(hit)
        return got

    def _order_waiting(self) -> None:
        """Longest prefix match (SGLang's LPM): resumed work first (preempted sequences, in
        their order); then the oldest new request if it has been the oldest for aging_bound
        seconds (all that arrived before it admitted: first come, first served would have
        admitted it by now); then the rest by the longest prefix the pool and the tier hold,
        longest first, ties by arrival. The bound counts from when a request becomes the
        oldest, not from its arrival: under a queue longer than the bound, every request
        is older than it, and counting from arrival would turn LPM back into FCFS."""
        if not 1 < len(self.waiting) <= LPM_MAX_WAITING:
            return
        now = time.time()
        units, i = [], 0
        while i < len(self.waiting):
            unit = self._group(self.waiting, i)
            units.append(unit)
            i += len(unit)
        fresh = [u[0].request for u in units if u[0].request.scheduled_time is None and not u[0].index]
        oldest = min(fresh, key=lambda r: r.arrival_time, default=None)
        if oldest is not None and oldest.oldest_since is None:
            oldest.oldest_since = now

        def rank(pos_unit: tuple[int, list[Sequence]]) -> tuple:
            pos, unit = pos_unit
            req = unit[0].request
            if req.scheduled_time is not None or unit[0].index:
                return (0, pos)
            if req is oldest and now - req.oldest_since >= self.aging_bound:
                return (1, pos)
            seq = unit[0]
            hit = self.kv.lookup_prefix(seq.token_ids, seq.hashes)
            return (2, -(len(hit) + self.kv.tier_prefix(seq.hashes, len(seq.token_ids), hit)), req.arrival_time, pos)
        ordered = sorted(enumerate(units), key=rank)
        self.waiting = deque(seq for _, unit in ordered for seq in unit)

    def _first_row(self, seq: Sequence, hit: list[int], scoring: _Scoring | None = None) -> int | None:
        """Where a newly admitted sequence's computing starts: after its prefix hit, or for
        prompt logprobs at the first token the cache keeps no logprobs for, less one (that
        row scores it), however far the KV hit goes. Takes the kept ones into the request.
        None: wait, a running request is computing the logprobs of the first hit block that
        has none (the choices of one question arrive together; one computes their context)."""
        cached = len(hit) * self.kv.block_size
        scores = seq.request.prompt_scores
        if scores is None or seq.index != 0:
            return cached
        kept = self.kv.cached_prompt_scores(seq.hashes, len(hit))
        if scoring is not None and len(kept) < len(hit) and seq.hashes.keys[len(kept)] in scoring.keys():
            return None
        if kept and len(kept) * self.kv.block_size - 1 > len(scores):
            joined = PromptScores(scores.k)
            for entry in kept:
                joined.extend(entry)
            seq.request.prompt_scores = scores = joined
        return min(cached, len(scores))

    def _kv_end(self, hit: list[int], end: int) -> int:
        """Slots a new sequence holds after its first chunk: at least its prefix hit."""
        return max(end, len(hit) * self.kv.block_size)

    def _admit_group(self, chunks: list, out: SchedulerOutput) -> int:
        """Allocate and start each (seq, hit, start, n) at the head of the queue; the
        tokens scheduled, or 0 if a sequence alone did not fit (a beam group's blocks were
        counted, and beams run under the paged policy, where counted blocks always fit).
        A group's members take their prefix hits before any takes fresh blocks: a fresh
        block may evict a cached-free one, which must not be a sibling's hit."""
        if len(chunks) > 1:
            for seq, hit, start, _ in chunks:
                self.kv.allocate_slots(seq.seq_id, seq.token_ids, len(hit) * self.kv.block_size, hit, seq.hashes,
                                       first_query=start)
        scheduled = 0
        for seq, hit, start, n in chunks:
            end = self._kv_end(hit, start + n)
            ahead = self._lookahead(seq, end)
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, end + ahead, hit, seq.hashes,
                                            lookahead=ahead, first_query=start)
            if copies is None:
                if len(chunks) > 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: its group's blocks were counted but it did not fit")
                return 0  # reserve-max: free blocks, but no contiguous run
            self.waiting.popleft()
            self._start(seq, start, len(hit) * self.kv.block_size)
            out.copies.extend(copies)
            self._add_scheduled(out, seq, n)
            scheduled += n
        return scheduled

    def _start(self, seq: Sequence, start: int, cached: int) -> None:
        req = seq.request
        if seq.num_output_tokens == 0 and seq.index == 0:
            req.num_cached_tokens = cached
            if req.prompt_scores is not None:
                self.kv.count_prompt_scores(seq.num_prompt_tokens - 1, len(req.prompt_scores))
        if req.scheduled_time is None:
            req.scheduled_time = time.time()
        seq.num_computed_tokens = start
        seq.reread_until = cached if start < cached else 0
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
        B = self.kv.block_size
        for s in out.scheduled:
            seq = s.seq
            table = self.kv.block_table(seq.seq_id)
            end = s.start + s.num_tokens
            draft = seq.draft
            propose = 0
            if self.spec_policy is not None and len(s.sample_for) == 1 and self._speculates(seq):
                propose = self.spec_policy.num_speculative_tokens
            slots = table.slots(s.start, end)
            reread = min(end, seq.reread_until) - s.start
            if reread > 0:  # their KV is a prefix hit's: read, never written over
                slots[:reread] = [-1] * reread
            chunks.append(ChunkPlan(
                seq.seq_id, s.start, seq.token_ids[s.start:end - len(draft)] + draft, slots,
                table.block_ids[:cdiv(end, B)],
                [SampleTarget(t.seq_id, t.params, t.seed, t.token_ids, t.num_prompt_tokens,
                              t.request.beam.num_candidates if t.request.beam else 0, propose, t.request.grammar)
                 for t in s.sample_for],
                list(draft), table.block_ids[cdiv(end, B):cdiv(table.num_tokens, B)] if propose else []))
            self._plan_scores(chunks[-1], seq)
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return StepPlan(chunks, out.copies, finished)

    @staticmethod
    def _plan_scores(chunk: ChunkPlan, seq: Sequence) -> None:
        """The prompt tokens this chunk's rows score, those not scored yet (a recompute after
        preemption scores nothing twice)."""
        got = seq.request.prompt_scores
        if got is None or seq.index != 0:
            return
        first, last = max(chunk.start, len(got)), min(chunk.end, seq.num_prompt_tokens - 1)
        if first < last:
            chunk.score_start, chunk.score_ids = first, seq.token_ids[first + 1:last + 1]
            chunk.score_top = got.k

    def _keeps_scores(self, seq: Sequence) -> bool:
        """Whether a sequence's prompt blocks get their logprobs kept as it computes them."""
        scores = seq.request.prompt_scores
        return self.kv.enable_prefix_caching and seq.index == 0 and scores is not None and \
            scores.k == self.max_logprobs

    def _add_prompt_scores(self, seq: Sequence, new: PromptScores) -> None:
        """A step's prompt logprobs into the request; each full prompt block whose tokens
        all have theirs now keeps them beside it (block b: tokens b*B .. b*B+B-1, held
        from index b*B - 1, as token 0 has none)."""
        scores, B = seq.request.prompt_scores, self.kv.block_size
        done = self._scored_blocks(seq)
        scores.extend(new)
        if self._keeps_scores(seq):
            for b in range(done, self._scored_blocks(seq)):
                self.kv.keep_prompt_scores(seq.hashes, b, scores.slice(max(b * B - 1, 0), (b + 1) * B - 1))

    def _scored_blocks(self, seq: Sequence) -> int:
        """Full prompt blocks whose every token has its logprob now (block b's from index b*B - 1)."""
        return min(len(seq.request.prompt_scores) + 1, seq.num_prompt_tokens) // self.kv.block_size

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
        """Preempt: drop their KV (swap: saved to the tier first, their full blocks); they
        resume from the front of the queue, in their order (a beam group stays together),
        through a prefix hit of what the pool and the tier kept."""
        for seq in seqs:
            if self.preemption_mode == "swap":
                self.kv.swap_out(seq.seq_id)
            self.kv.free(seq.seq_id)
            seq.draft = []
            seq.spec_tokens = []
            seq.num_computed_tokens = 0
            seq.reread_until = 0
            seq.status = SeqStatus.WAITING
            self.num_preemptions += 1
            out.preempted.append(seq)
        self.waiting.extendleft(reversed(seqs))

    # -- after the forward: the one update path ------------------------------
    def update_from_output(self, out: SchedulerOutput, res: StepResult, now: float | None = None) -> StepUpdate:
        """Everything a step's result changes, in one place: computed counts, the accepted
        drafts and their rolled-back slots, forks of pending samples, each new token
        appended with its logprobs, stops on token ids and lengths, beam-search choices
        (fork, extend, prune), prompt logprobs, and requests whose sampling failed. Stop
        strings need text: the output processor checks them (stop_at)."""
        now = time.time() if now is None else now
        up = StepUpdate(out)
        self.steps += 1
        self.computed_prompt_tokens += out.num_prefill_tokens
        for s in out.scheduled:
            seq = s.seq
            if res.prompt_logprobs and seq.seq_id in res.prompt_logprobs and seq.request.prompt_scores is not None:
                self._add_prompt_scores(seq, res.prompt_logprobs[seq.seq_id])
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.spec_tokens = res.drafts.get(seq.seq_id, [])  # for its next step
            if seq.draft:
                accepted = self._verified(s, res.accepted.get(seq.seq_id, []), seq.seq_id in res.tokens)
                run = accepted + ([res.tokens[seq.seq_id]] if seq.seq_id in res.tokens else [])
                self._append_run(up, seq, run, {}, now)
                continue
            seq.num_computed_tokens = s.start + s.num_tokens
            # Pending samples fork off first: each copies the parent's tokens before any grows.
            sampled = [t for t in s.sample_for if t.seq_id in res.tokens]  # failed ones: below; beams: candidates
            for target in sampled:
                if target is not seq:
                    target.token_ids = list(seq.token_ids)
                    self.fork(seq, target)
            for target in sampled:
                self._append_run(up, target, [res.tokens[target.seq_id]], res.logprobs, now)
        if res.logprobs:  # beams' candidates come as logprobs
            for req in self._beam_groups(out, res.logprobs):
                up.touched[req.request_id] = req
                up.new_tokens += self._advance_beams(req, now)
        if res.errors:  # rare: skip the walk over the batch on every ordinary step
            for s in out.scheduled:
                for seq in s.sample_for:
                    if seq.seq_id in res.errors and seq.request.error is None:
                        self.fail(seq.request, res.errors[seq.seq_id])
                        up.touched[seq.request.request_id] = seq.request
        return up

    def _append_run(self, up: StepUpdate, seq: Sequence, tokens: list[int], logprobs: dict, now: float) -> None:
        """Append a sequence's new tokens one by one, each checked for a stop; a token after
        the one that stopped it is dropped (a verified run of drafts can end early)."""
        req = seq.request
        up.touched[req.request_id] = req
        if req.error is not None:
            return
        for token in tokens:
            if seq.finished:
                break
            seq.token_ids.append(token)
            self.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
                self.prompt_tokens += len(req.prompt_token_ids)
            lp = logprobs.get(seq.seq_id)
            if lp is not None:
                seq.cumulative_logprob += lp[token].logprob
                if seq.params.logprobs is not None:  # else only best_of's ranking asked for it
                    seq.logprobs.append(lp)
            up.new_tokens.append((seq, token))
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        """Stops on token ids and lengths (vLLM's order); nothing but the length limits ends
        an output before min_tokens."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
                return self.finish(seq, "stop", token)
        if self.at_length_limit(seq.request, seq.num_output_tokens):
            self.finish(seq, "length")

    def tokens_left(self, req: Request, num_output_tokens: int) -> int:
        """The one length rule: output tokens a request may still add, under its max_tokens
        and the context's max_model_len."""
        return min(req.max_tokens - num_output_tokens, self.max_model_len - len(req.prompt_token_ids) - num_output_tokens)

    def at_length_limit(self, req: Request, num_output_tokens: int) -> bool:
        return self.tokens_left(req, num_output_tokens) <= 0

    def stop_at(self, seq: Sequence, num_output_tokens: int, stop: str) -> None:
        """The output processor found stop string `stop` ending at output token
        num_output_tokens: the tokens after it go (not generated, as far as anyone
        counts), and the sequence stops there, if a length limit has not stopped it."""
        extra = seq.num_output_tokens - num_output_tokens
        if extra > 0:
            del seq.token_ids[len(seq.token_ids) - extra:]
            del seq.logprobs[num_output_tokens:]
            self.generation_tokens -= extra
        if seq.finished:  # by a length limit (or an EOS after the stop string) at the same step
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            self.finish(seq, "stop", stop)

    def fail(self, req: Request, error: str) -> None:
        """Something went wrong for this request alone inside a step: end it (its blocks
        go back now) and let the rest of the batch go on."""
        logger.warning("request %s failed inside a step: %s", req.request_id, error)
        req.error = error
        for seq in req.seqs:
            if seq.status is SeqStatus.PENDING:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
            else:
                self.finish(seq, "error")

    def _verified(self, s: ScheduledSeq, accepted: list[int], ok: bool) -> list[int]:
        """A speculating decode after verification: its KV is right up to the last accepted
        draft; the rest of its lookahead slots roll back."""
        seq = s.seq
        drafted, seq.draft = len(seq.draft), []
        seq.num_computed_tokens = s.start + 1 + len(accepted)
        # The lookahead slots past the kept tokens stay: the draft model wrote its next
        # proposal's KV there this step.
        self.kv.rollback(seq.seq_id, seq.num_computed_tokens, seq.token_ids + accepted,
                         lookahead=self._lookahead(seq, seq.num_computed_tokens))
        if ok:
            self.spec.record(drafted, len(accepted))
        return accepted

    # -- beam search -----------------------------------------------------------
    @staticmethod
    def _beam_groups(out: SchedulerOutput, logprobs: dict) -> list[Request]:
        """Beam groups whose live beams all have their candidates after this step."""
        ready: dict[str, Request] = {}
        for s in out.scheduled:
            for seq in s.sample_for:
                req = seq.request
                if req.beam is not None and seq.seq_id in logprobs and not seq.finished:
                    req.candidates[seq.seq_id] = [(t, lp.logprob) for t, lp in logprobs[seq.seq_id].items()]
                    if all(b.seq_id in req.candidates for b in req.beams):
                        ready[req.request_id] = req
        return list(ready.values())

    def _advance_beams(self, req: Request, now: float) -> list[tuple[Sequence, int]]:
        """One beam-search step: choose the next beams (pure, in engine.beam), then apply
        it to block tables: a beam chosen once extends itself, chosen again forks (shared
        blocks, copy-on-write of the partial last one), not chosen is freed now."""
        beams, group = req.beams, req.beam
        ignore_eos = group.params.ignore_eos

        def ends(token: int, gen_len: int) -> str | None:
            if not ignore_eos and token in self.eos_token_ids:
                return "stop"
            return "length" if self.at_length_limit(req, gen_len) else None
        chosen = group.step([req.candidates.pop(b.seq_id) for b in beams], [b.output_token_ids for b in beams], ends)
        if req.first_token_time is None:
            req.first_token_time = now
            self.prompt_tokens += len(req.prompt_token_ids)
        extended: set[int] = set()
        nxt: list[Sequence] = []
        for c in chosen:  # forks first: a child copies its parent's tokens before the parent grows
            parent = beams[c.beam]
            if c.beam in extended:
                child = Sequence(self.new_seq_id(), req, len(req.seqs), parent.token_ids + [c.token],
                                 len(req.prompt_token_ids), parent.seed)
                req.seqs.append(child)
                self.fork(parent, child)
                nxt.append(child)
            else:
                extended.add(c.beam)
                nxt.append(parent)
        for seq, c in zip(nxt, chosen):
            if seq is beams[c.beam]:
                seq.token_ids.append(c.token)
        for i, b in enumerate(beams):
            if i not in extended:
                self.finish(b, "pruned")
        req.beams = [] if group.done else nxt
        if group.done:
            for b in nxt:
                self.finish(b, "stop")
        self.generation_tokens += len(chosen)
        return [(seq, c.token) for seq, c in zip(nxt, chosen)]

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
