"""The KV tier's part in a step (the scheduler's side of the connector): a waiting sequence's
prefix hit is extended by the blocks the tier holds, loaded into fresh pool blocks before the
forward; a sequence preempted by swap saves its blocks there first."""
from __future__ import annotations

from ..config import PREEMPTION_MODES
from ..kv.prefix_hit import PrefixHit
from ..util import cdiv
from .hooks import StepHook
from .sequence import Sequence
from .step_types import Wait

# A tier hit that waits: for blocks (nobody passes it); for the next step's loads (others may).
TIER_NO_ROOM = Wait("its tier hit waits for free blocks", True)
TIER_LATER = Wait("this step's tier loads are spent")


class TierLoads(StepHook):
    def __init__(self, preemption_mode: str = "recompute") -> None:
        """preemption_mode: recompute drops a victim's KV (a resume takes what the prefix cache
        still has); swap first saves its full blocks to the tier."""
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.preemption_mode = preemption_mode
        self._budget, self._loaded = 0, False

    def begin_step(self) -> None:
        """Blocks a step may read from the tier: a step's token budget of them, but the first
        request with a tier hit loads its whole hit (never recomputes what it could load)."""
        sched = self.scheduler
        self._budget, self._loaded = cdiv(sched.max_num_batched_tokens, sched.kv.block_size), False

    def admit(self, seq, hit, start, alone):
        """The pool hit extended by the blocks loaded from the tier. A load takes the whole
        hit's blocks at once (computing it would take them a chunk a step), so it waits until
        they fit beside the prompt's first chunk with a block to spare for each running
        sequence (TIER_NO_ROOM: nobody passes it); without the spare blocks, the next step
        preempts the newest sequence, often this one, which comes back the same way: a thrash
        measured at 14x the preemptions of recompute. With nothing running it loads what
        fits. TIER_LATER when this step's loads are spent (the first tier hit of a step loads whole)."""
        if not alone:
            return hit, start
        sched = self.scheduler
        kv, B = sched.kv, sched.kv.block_size
        plan = kv.tier_plan(seq.hashes, len(seq.token_ids), hit)
        n = plan.longest() - plan.start
        if not n:
            return hit, start
        reads = plan.reads(plan.start + n)   # every group's blocks
        if self._loaded and reads > self._budget:
            return TIER_LATER
        rest = len(seq.token_ids) - (len(hit) + n) * B
        held = hit.per_group if isinstance(hit, PrefixHit) else [hit]
        room = kv.pool.num_available - sum(1 for h in held for b in h if b >= 0 and kv.pool.is_available(b)) - \
            cdiv(min(rest, sched.long_prefill_token_threshold), B) * len(kv.groups) - 1
        if sched.running and reads > room - len(sched.running):
            return TIER_NO_ROOM
        limit = max(0, min(reads, room))
        got = kv.load_from_tier(seq.seq_id, seq.hashes, len(seq.token_ids), hit, limit, plan, seq.token_ids)
        self._loaded = True
        self._budget -= limit
        return got, start + (len(got) - len(hit)) * B

    def preempted(self, seq: Sequence) -> None:
        if self.preemption_mode == "swap":
            self.scheduler.kv.swap_out(seq.seq_id)
