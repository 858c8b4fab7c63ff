"""Admission: which waiting sequences start this step, in the queue policy's order, within
the step's token budget, the sequence cap, the partial-prefill slots and the KV pool.

Each waiting unit (a sequence, or a beam group admitted whole) gets a typed answer: the
chunks it starts with (AdmitChunk), or why it waits (step_types.Wait): a unit that steps
aside lets the ones behind it pass; one that holds the queue stops admission for the step.
Hooks may move a sequence's prefix hit or first computed position, or make it wait.
Each function takes the scheduler.Scheduler it admits for (`sched`).
"""
from __future__ import annotations

from .queue_policy import unit_at
from .sequence import Sequence, SeqStatus
from .step_types import (COMPILING, NO_BLOCKS, NO_BUDGET, NO_SEATS, PARTIAL_PREFILLS, AdmitChunk, SchedulerOutput,
                         Wait)


def future_seats(seq: Sequence) -> int:
    """Seats a unit will still take beyond its sequences: the samples of n > 1 not yet
    forked, or a beam group's beams to come (counted once, on its first live beam)."""
    req = seq.request
    if req.beam is not None:
        return req.beam.width - len(req.beams) if req.beams and req.beams[0] is seq else 0
    if seq.index != 0 or seq.num_output_tokens:
        return 0
    return sum(1 for c in req.seqs if c.status is SeqStatus.PENDING)


def admit_waiting(sched, out: SchedulerOutput, budget: int, long_prefills: int) -> None:
    """Admit waiting units in the policy's order. Samples of n > 1 and a beam group's future
    beams count against max_num_seqs from admission."""
    if not sched.waiting:
        return
    seats = len(sched.running) + sum(future_seats(s) for s in sched.running)
    sched.waiting = sched.policy.order(sched.waiting, lambda s: _prefix_blocks(sched, s))
    aside: list[Sequence] = []   # units that stepped aside this step, back at the front after
    while sched.waiting and budget > 0:
        group = unit_at(sched.waiting, 0)
        need_seats = len(group) + future_seats(group[0])
        verdict = admit_unit(sched, group, budget, long_prefills) \
            if seats + need_seats <= sched.max_num_seqs or not sched.running else NO_SEATS
        if isinstance(verdict, Wait):
            if verdict.holds_queue:
                break
            aside += [sched.waiting.popleft() for _ in group]
            continue
        admitted = start_unit(sched, verdict, out)
        if not admitted:  # reserve-max: enough free blocks, but no contiguous run
            break
        budget -= admitted
        long_prefills += _long(sched, verdict)
        seats += need_seats
    sched.waiting.extendleft(reversed(aside))  # back at the front, in their order


def _prefix_blocks(sched, seq: Sequence) -> int:
    """Blocks of a waiting sequence's prompt the pool and the tier hold (the LPM policy's key)."""
    hit = sched.kv.lookup_prefix(seq.token_ids, seq.hashes)
    return len(hit) + sched.kv.tier_prefix(seq.hashes, len(seq.token_ids), hit)


def _long(sched, chunks: list[AdmitChunk]) -> int:
    return sum(len(c.seq.token_ids) - c.start > sched.long_prefill_token_threshold for c in chunks)


def admit_unit(sched, group: list[Sequence], budget: int, long_prefills: int) -> list[AdmitChunk] | Wait:
    """The chunks a waiting unit starts with this step, or why it waits."""
    kv, B = sched.kv, sched.kv.block_size
    req = group[0].request
    if req.compiling is not None:  # its grammar is not compiled yet
        return COMPILING
    chunks: list[AdmitChunk] = []
    alone = len(group) == 1
    for j, seq in enumerate(group):
        hit = kv.lookup_prefix(seq.token_ids, seq.hashes)
        start = len(hit) * B
        for hook in sched.hooks:
            got = hook.admit(seq, hit, start, alone)
            if isinstance(got, Wait):
                return got
            hit, start = got
        if start < len(hit) * B and kv.windowed:
            # Rows re-read over a hit need the keys of their own windows, which a window hit
            # may lack: under a sliding window they are recomputed.
            hit = kv.shorten_hit(hit, start // B)
            start = len(hit) * B
        share = (budget - sum(c.num_tokens for c in chunks)) // (len(group) - j)
        chunks.append(AdmitChunk(seq, hit, start, min(len(seq.token_ids) - start, share,
                                                      sched.long_prefill_token_threshold)))
    if alone and _long(sched, chunks) and long_prefills >= sched.max_num_partial_prefills:
        return PARTIAL_PREFILLS
    if any(c.num_tokens <= 0 for c in chunks):
        return NO_BUDGET
    if not alone and sum(kv.blocks_needed(c.seq.seq_id, _kv_end(c, B), c.hit) for c in chunks) \
            + sched.extra_blocks(group[0]) > kv.pool.num_available:
        return NO_BLOCKS
    return chunks


def _kv_end(c: AdmitChunk, block_size: int) -> int:
    """Slots a new sequence holds after its first chunk: at least its prefix hit."""
    return max(c.start + c.num_tokens, len(c.hit) * block_size)


def start_unit(sched, chunks: list[AdmitChunk], out: SchedulerOutput) -> int:
    """Allocate and start each chunk's sequence (at the head of the queue); the tokens
    scheduled, or 0 if a sequence alone did not fit (a beam group's blocks were counted, and
    beams run under the paged policy, where counted blocks always fit). A group's members
    take their prefix hits before any takes fresh blocks: a fresh block may evict a
    cached-free one, which must not be a sibling's hit."""
    kv, B = sched.kv, sched.kv.block_size
    if not sched.hold(chunks[0].seq):   # what the hooks keep first (an adapter's pages): counted with its blocks
        return 0
    for c in chunks[1:]:
        sched.hold(c.seq)
    if len(chunks) > 1:
        for c in chunks:
            kv.allocate_slots(c.seq.seq_id, c.seq.token_ids, len(c.hit) * B, c.hit, c.seq.hashes, first_query=c.start)
    scheduled = 0
    for c in chunks:
        seq, end = c.seq, _kv_end(c, B)
        ahead = sched.lookahead(seq, end)
        copies = kv.allocate_slots(seq.seq_id, seq.token_ids, end + ahead, c.hit, seq.hashes, lookahead=ahead,
                                   first_query=c.start)
        if copies is None:
            if len(chunks) > 1:
                raise RuntimeError(f"sequence {seq.seq_id}: its group's blocks were counted but it did not fit")
            sched.drop(seq)   # an adapter's pages stay resident, idle: revived for free when it fits
            return 0
        sched.waiting.popleft()
        sched.start(seq, c.start, len(c.hit) * B)
        out.copies.extend(copies)
        sched.add_scheduled(out, seq, c.num_tokens)
        scheduled += c.num_tokens
    return scheduled
