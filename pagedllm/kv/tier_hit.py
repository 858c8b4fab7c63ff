"""A prefix hit extended from the second tier, over every layer group (kv.groups).

A hit of k blocks needs, in each group, the blocks its next queries read: a full group all of
0 .. k-1, a window group those from first_window_block(k * B) on, a state group only block
k - 1 (the state its first computed token starts from). Each needed block comes from the
pool's hit, from the pool (cached under the group's key, its bytes written), or from the tier,
read into a fresh block. So the longest hit the tier extends is the largest k whose needed
blocks all come from somewhere, as the pool's own hit rule (GroupManager.longest_hit); for a
model of one full group it is the pool hit's run continued by the tier's.

Plain Python, no torch: block ids and keys. The connector reads and pins; here the choice of
what to read is made.
"""
from __future__ import annotations

from dataclasses import dataclass

from .block_table import RELEASED
from .connector import KVConnector
from .single_type import GroupManager

TIER = -2   # a needed block the tier holds (and the pool does not)


@dataclass(slots=True)
class TierHit:
    """Where each group's blocks 0 .. n-1 of a prompt come from: a pool block id, TIER, or
    None (nowhere); `start` is the pool hit's length, what any tier hit extends."""
    groups: list[GroupManager]
    keys: list[list[int]]                 # each group's keys of blocks 0 .. n-1
    source: list[list[int | None]]        # each group's source of blocks 0 .. n-1
    start: int

    def needed(self, gi: int, k: int) -> range:
        """The blocks group gi reads for a hit of k blocks."""
        g = self.groups[gi]
        return range(min(g.first_window_block(k * g.block_size), k), k)

    def valid(self, limit: int | None = None) -> list[int]:
        """The hit lengths k > start (each read at most `limit` blocks from the tier) whose needed
        blocks all come from somewhere, ascending."""
        n = len(self.keys[0]) if self.keys else 0
        last_missing = [max((i for i in range(min(self.start, n)) if self.source[gi][i] is None), default=-1)
                        for gi in range(len(self.groups))]
        found = []
        for k in range(self.start + 1, n + 1):
            for gi, src in enumerate(self.source):
                if src[k - 1] is None:
                    last_missing[gi] = k - 1
            if all(m < self.needed(gi, k).start for gi, m in enumerate(last_missing)) and \
                    (limit is None or self.reads(k) <= limit):
                found.append(k)
        return found

    def longest(self, limit: int | None = None) -> int:
        """The longest hit (the pool's own when the tier adds nothing)."""
        return max(self.valid(limit), default=self.start)

    def refresh(self) -> None:
        """Each pool source looked up again: a block no pin held may have been evicted since."""
        for g, src, ks in zip(self.groups, self.source, self.keys):
            for i, b in enumerate(src):
                if b is not None and b >= 0 and g.lookup(ks[i]) != b:
                    src[i] = None

    def reads(self, k: int) -> int:
        """Blocks a hit of k blocks reads from the tier."""
        return sum(1 for gi, src in enumerate(self.source) for i in self.needed(gi, k) if src[i] == TIER)


def tier_hit(groups: list[GroupManager], connector: KVConnector, keys: list[list[int]],
             hit: list[list[int]]) -> TierHit:
    """Each group's sources for a prompt's blocks (keys[g]: group g's keys of its full blocks
    but the last token's), after a pool hit `hit` (per group): the store is asked once, for
    the keys the pool lacks from where any longer hit starts reading."""
    start = len(hit[0])
    source: list[list[int | None]] = []
    ask: list[int] = []
    for g, ks, h in zip(groups, keys, hit):
        src = [b if b != RELEASED else None for b in h]
        src += [g.lookup(k) for k in ks[start:]]
        lo = g.first_window_block((start + 1) * g.block_size)
        ask += [ks[i] for i in range(lo, len(ks)) if src[i] is None and g.pool.lookup(ks[i]) is None]   # in flight: not asked
        source.append(src)
    stored = connector.have(ask)
    for src, ks in zip(source, keys):
        for i, b in enumerate(src):
            if b is None and ks[i] in stored:
                src[i] = TIER
    return TierHit(groups, keys, source, start)


def load_hit(plan: TierHit, connector: KVConnector, seq_id: int, limit: int) -> list[list[int]]:
    """Carry out the longest hit reading at most `limit` blocks from the tier: its pool blocks
    pinned first (a fresh block never evicts one of them), then each tier block read into a
    fresh one. A read the store cannot serve (or a pool down to its last block) makes that
    block missing, and the hit falls back to the longest one still whole. Each group's blocks
    of the hit, RELEASED where its queries read none."""
    k = plan.longest(limit)
    if k == plan.start:
        return _blocks(plan, k)   # the pool's own hit
    pinned = _pin(plan, connector, plan.start, set())   # the pool hit stays whole
    while True:
        # Pinned again at each length: a shorter hit reads pool blocks the longer one did not
        # (a window group's earlier blocks), and the next fresh block must not evict them.
        pinned = _pin(plan, connector, k, pinned)
        todo = sorted((i, gi) for gi in range(len(plan.groups)) for i in plan.needed(gi, k)
                      if plan.source[gi][i] == TIER)
        loaded = connector.load_blocks(seq_id, [(plan.keys[gi][i], i, gi) for i, gi in todo])
        for (i, gi), b in zip(todo, loaded):
            plan.source[gi][i] = b
        if len(loaded) == len(todo):
            return _blocks(plan, k)
        i, gi = todo[len(loaded)]
        plan.source[gi][i] = None   # the block the store could not serve (or no room for)
        plan.refresh()   # the fresh blocks taken so far may have evicted a shorter hit's pool blocks
        k = max([v for v in plan.valid() if v <= k], default=plan.start)


def _pin(plan: TierHit, connector: KVConnector, k: int, pinned: set[int]) -> set[int]:
    """Pin the pool blocks a hit of k blocks reads that are not pinned yet."""
    blocks = {plan.source[gi][i] for gi in range(len(plan.groups)) for i in plan.needed(gi, k)} - {None, TIER}
    connector.pin_for_step(sorted(blocks - pinned))
    return pinned | blocks


def _blocks(plan: TierHit, k: int) -> list[list[int]]:
    out = []
    for gi in range(len(plan.groups)):
        need = plan.needed(gi, k)
        out.append([RELEASED] * need.start + [plan.source[gi][i] for i in need])
    return out
