"""Which data-parallel replica serves a request: plain Python, no torch.

prefix: consistent hashing with bounded loads. A request's key is a hash of its prompt's
first full KV blocks (and its cache salt: tenants isolated per key never share blocks, so
they need not share a replica). The key's point on a hash ring (each replica owns many
virtual nodes) names the replica likely to hold those blocks; adding a replica moves only
the keys whose points the new one takes over. Walking the ring from the key, the first live
replica under its load bound wins, so a hot prefix spills to the next replica on the ring,
not everywhere. round-robin and least-loaded ignore the prompt.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..config import ROUTER_POLICIES

VIRTUAL_NODES = 160      # per replica: the ring's spread of keys is within ~10 % of even
PREFIX_BLOCKS = 4        # at most this many first blocks make the key: a shared system prompt
                         # of that length routes together, whatever the user turn after it
LOAD_FACTOR = 1.25       # c of "bounded loads": no replica above c x the mean in flight ...
LOAD_SLACK = 1           # ... plus this, so a few requests of one prefix stay together
MAX_KV_USAGE = 0.95      # a replica with its KV pool this full takes no affinity traffic


@dataclass(slots=True)
class ReplicaLoad:
    """What the router knows of a replica when it decides."""
    in_flight: int = 0       # requests sent and not finished (waiting + running + in transit)
    kv_usage: float = 0.0    # fraction of its KV blocks held by requests
    alive: bool = True


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_key(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
               max_blocks: int = PREFIX_BLOCKS) -> int | None:
    """Hash of the prompt's first full blocks (up to max_blocks) and its salt; None when
    the prompt has no full block (nothing the prefix cache could share)."""
    full = min(len(token_ids) // block_size, max_blocks)
    if full == 0:
        return None
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(cache_salt).encode())
    h.update(b"\x00" + ",".join(map(str, token_ids[:full * block_size])).encode())
    return int.from_bytes(h.digest(), "big")


class HashRing:
    """Replica ids on a ring of 64-bit points, VIRTUAL_NODES points each."""

    def __init__(self, replicas: Sequence[int] = (), vnodes: int = VIRTUAL_NODES) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[int] = []
        self.replicas: set[int] = set()
        for r in replicas:
            self.add(r)

    def add(self, replica: int) -> None:
        if replica in self.replicas:
            return
        self.replicas.add(replica)
        for v in range(self.vnodes):
            p = _point(f"replica-{replica}#{v}")
            i = bisect.bisect(self._points, p)
            self._points.insert(i, p)
            self._owners.insert(i, replica)

    def walk(self, key: int) -> Iterator[int]:
        """Every replica once, in ring order from the key's point (its owner first)."""
        if not self._points:
            return
        start, seen, n = bisect.bisect(self._points, key), set(), len(self._points)
        for k in range(n):
            r = self._owners[(start + k) % n]
            if r not in seen:
                seen.add(r)
                yield r
                if len(seen) == len(self.replicas):
                    return

    def owner(self, key: int) -> int:
        return next(self.walk(key))


def load_bound(loads: Sequence[ReplicaLoad], factor: float = LOAD_FACTOR, slack: int = LOAD_SLACK) -> int:
    """Most requests a live replica may hold once this one is added: ceil(c x mean) + slack."""
    live = [x for x in loads if x.alive]
    total = sum(x.in_flight for x in live) + 1
    return math.ceil(factor * total / max(len(live), 1)) + slack


class Router:
    """choose(token ids, salt, loads) -> replica index, by the configured policy."""

    def __init__(self, num_replicas: int, policy: str = "prefix", block_size: int = 16,
                 factor: float = LOAD_FACTOR, slack: int = LOAD_SLACK, max_kv_usage: float = MAX_KV_USAGE) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {num_replicas!r}")
        self.policy, self.block_size = policy, block_size
        self.factor, self.slack, self.max_kv_usage = factor, slack, max_kv_usage
        self.ring = HashRing(range(num_replicas))
        self._next = 0  # round-robin's turn

    def choose(self, token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[ReplicaLoad]) -> int:
        """A live replica's index; ValueError when none is live."""
        if not any(x.alive for x in loads):
            raise ValueError("no live replica")
        if self.policy == "round-robin":
            return self._round_robin(loads)
        key = prefix_key(token_ids, self.block_size, cache_salt) if self.policy == "prefix" else None
        if key is None:
            return least_loaded(loads)
        bound = load_bound(loads, self.factor, self.slack)
        for r in self.ring.walk(key):
            x = loads[r]
            if x.alive and x.in_flight + 1 <= bound and x.kv_usage < self.max_kv_usage:
                return r
        return least_loaded(loads)  # every replica is full or busy: spread, affinity lost

    def _round_robin(self, loads: Sequence[ReplicaLoad]) -> int:
        n = len(loads)
        for k in range(n):
            r = (self._next + k) % n
            if loads[r].alive:
                self._next = r + 1
                return r
        raise ValueError("no live replica")  # unreachable: choose() checked


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    """The live replica with the fewest requests in flight, then the emptiest KV pool."""
    return min((i for i, x in enumerate(loads) if x.alive), key=lambda i: (loads[i].in_flight, loads[i].kv_usage, i))
