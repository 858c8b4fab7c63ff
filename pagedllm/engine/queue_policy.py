"""Queue policies: the order waiting requests are admitted in, and which running one is
preempted when blocks run out (vLLM's --scheduling-policy, and SGLang's LPM). The scheduler
is given one and asks it each step; a beam group's beams stay one unit, consecutive.

- fcfs: arrival order; resumed (preempted) work first; the newest running unit is preempted
  (the last of the running list, which each policy keeps in the order it serves it).
- lpm: the longest prefix in the pool or the tier first (SGLang's longest prefix match), with
  an aging bound so that no request waits for ever behind others' prefixes.
- priority: vLLM's `priority` (lower runs first, then arrival), waiting and running alike: the
  running unit of the lowest priority (then the newest) is preempted.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence as Seq

from ..config import SCHEDULING_POLICIES
from .sequence import Sequence

# Longest-prefix-match ordering looks every waiting request up each step: past this many
# waiting it costs more than it wins, and admission is first come, first served (SGLang's rule).
LPM_MAX_WAITING = 128


def units(seqs: Seq[Sequence], start: int = 0) -> list[list[Sequence]]:
    """The scheduling units from `start` on: a beam group's consecutive beams, else one sequence."""
    out: list[list[Sequence]] = []
    i = start
    while i < len(seqs):
        unit = unit_at(seqs, i)
        out.append(unit)
        i += len(unit)
    return out


def unit_at(seqs: Seq[Sequence], start: int) -> list[Sequence]:
    first = seqs[start]
    if first.request.beam is None:
        return [first]
    unit = [first]
    for i in range(start + 1, len(seqs)):
        if seqs[i].request is not first.request:
            break
        unit.append(seqs[i])
    return unit


def resumed(seq: Sequence) -> bool:
    """Work preempted once (or a sample of n waiting to start): it goes ahead of new requests."""
    return seq.request.scheduled_time is not None or seq.index != 0


class QueuePolicy:
    """First come, first served (vLLM's fcfs)."""
    name = "fcfs"

    def order(self, waiting: deque[Sequence], prefix_blocks: Callable[[Sequence], int]) -> deque[Sequence]:
        """The waiting queue in admission order (`prefix_blocks(seq)`: blocks of its prompt the
        pool and the tier hold). FCFS keeps it as it is: resumed work was put back in front."""
        return waiting

    def arrange(self, running: list[Sequence]) -> None:
        """Put the running list in the order its units are served each step (in place); the
        last unit is the one preempted when blocks run out. FCFS: admission order."""


class LongestPrefixMatch(QueuePolicy):
    """Resumed work first (in its order); then the oldest new request if it has been the
    oldest for `aging_bound` seconds (all that arrived before it admitted: first come, first
    served would have admitted it by now); then the rest by the longest prefix the pool and the
    tier hold, longest first, ties by arrival. The bound counts from when a request becomes
    the oldest, not from its arrival: under a queue longer than the bound, every request is
    older than it, and counting from arrival would turn LPM back into FCFS."""
    name = "lpm"

    def __init__(self, aging_bound: float = 2.0) -> None:
        if not aging_bound >= 0:
            raise ValueError(f"scheduling_aging_bound must be >= 0 seconds, got {aging_bound!r}")
        self.aging_bound = aging_bound

    def order(self, waiting: deque[Sequence], prefix_blocks: Callable[[Sequence], int]) -> deque[Sequence]:
        if not 1 < len(waiting) <= LPM_MAX_WAITING:
            return waiting
        now = time.time()
        found = units(waiting)
        fresh = [u[0].request for u in found if not resumed(u[0])]
        oldest = min(fresh, key=lambda r: r.arrival_time, default=None)
        if oldest is not None and oldest.oldest_since is None:
            oldest.oldest_since = now

        def rank(pos_unit: tuple[int, list[Sequence]]) -> tuple:
            pos, unit = pos_unit
            req = unit[0].request
            if resumed(unit[0]):
                return (0, pos)
            if req is oldest and now - req.oldest_since >= self.aging_bound:
                return (1, pos)
            return (2, -prefix_blocks(unit[0]), req.arrival_time, pos)
        return deque(seq for _, unit in sorted(enumerate(found), key=rank) for seq in unit)


class Priority(QueuePolicy):
    """vLLM's priority scheduling: lower `priority` first, then earlier arrival (a preempted
    request keeps its place by both)."""
    name = "priority"

    def order(self, waiting: deque[Sequence], prefix_blocks: Callable[[Sequence], int]) -> deque[Sequence]:
        if len(waiting) < 2:
            return waiting
        found = sorted(enumerate(units(waiting)), key=lambda pu: (pu[1][0].request.priority,
                                                                   pu[1][0].request.arrival_time, pu[0]))
        return deque(seq for _, unit in found for seq in unit)

    def arrange(self, running: list[Sequence]) -> None:
        """Highest priority served first, so the lowest (then the newest) is preempted first.
        Stable, and a request's sequences share its key: a beam group stays consecutive."""
        running.sort(key=lambda s: (s.request.priority, s.request.arrival_time))


def make_policy(name: str, aging_bound: float = 2.0) -> QueuePolicy:
    if name not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {name!r}")
    if name == "lpm":
        return LongestPrefixMatch(aging_bound)
    if not aging_bound >= 0:
        raise ValueError(f"scheduling_aging_bound must be >= 0 seconds, got {aging_bound!r}")
    return Priority() if name == "priority" else QueuePolicy()
