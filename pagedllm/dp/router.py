"""Which data-parallel replica serves a request: plain Python, no torch.

prefix: affinity on what the replicas hold. The router keeps, per replica, a record of the
chained block hashes (kv/hashing.py: salted by the cache salt, so tenants isolated per key
never share a record) of the full prompt blocks it sent there; a replica's prefix cache
holds those blocks, or held them until its own LRU reused them. A request goes to the live
replica under its load bound whose record matches the longest run of its leading blocks,
once that run is a fifth of the prompt's full blocks or more: every chat behind one system
prompt finds the replica that computed it, however short the system prompt, as long as it
fills a block and is not lost in a long user turn. Ties go by a consistent-hash ring
walked from a key of the prompt's first blocks. A new prefix (no such match, or one sharing
only a preamble with others) goes to the replica with the fewest requests in flight, the
ring's first of those, so new prefixes spread evenly when idle and toward spare capacity
under load.
Records are LRU-bounded (an attacker sending endless distinct prompts flushes them, as
it would flush the replicas' caches, but never grows them), and a dead replica's record
is forgotten: its successor starts with an empty pool. round-robin and least-loaded
ignore the prompt.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..config import ROUTER_POLICIES
from ..kv.hashing import BlockHashes

VIRTUAL_NODES = 160      # per replica: the ring's spread of keys is within ~10 % of even
PREFIX_BLOCKS = 4        # at most this many first blocks make the ring's key
LOAD_FACTOR = 1.25       # c of "bounded loads": no replica above c x the mean in flight ...
LOAD_SLACK = 1           # ... plus this, so a few requests of one prefix stay together
MAX_KV_USAGE = 0.95      # a replica with its KV pool this full takes no affinity traffic
MIN_MATCH_FRACTION = 0.2  # a record's match counts from this share of the prompt's full blocks on:
                          # a preamble every system prompt opens with must not pull them all to
                          # the one replica that saw it first (SGLang's cache_aware: 0.3 of chars)
MAX_RECORD_BLOCKS = 1 << 16  # block hashes a replica's record keeps at most (~7 MB): a record
                             # larger than the replica's pool would remember what it evicted


@dataclass(slots=True)
class ReplicaLoad:
    """What the router knows of a replica when it decides."""
    in_flight: int = 0       # requests sent and not finished (waiting + running + in transit)
    kv_usage: float = 0.0    # fraction of its KV blocks held by requests
    alive: bool = True


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained, salted hashes of the prompt's full blocks: the keys the replica's
    prefix cache files them under."""
    return BlockHashes(block_size, cache_salt).update(token_ids)


def prefix_key(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
               max_blocks: int = PREFIX_BLOCKS) -> int | None:
    """The ring's key: the chained hash of the prompt's first full blocks (up to
    max_blocks), salt included; None when the prompt has no full block (nothing the prefix
    cache could share)."""
    keys = block_hashes(token_ids[:max_blocks * block_size], block_size, cache_salt)
    return keys[-1] if keys else None


class BlockRecord:
    """The block hashes routed to one replica, least recently routed first, at most
    `capacity` of them. Hashes are chained, so a prompt's leading run of hashes found here
    is a prefix this replica computed."""

    def __init__(self, capacity: int = MAX_RECORD_BLOCKS) -> None:
        if capacity < 1:
            raise ValueError(f"record capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def matched(self, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks this replica was sent."""
        n = 0
        for h in hashes:
            if h not in self._keys:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        """Record a routed prompt's blocks. Touched last to first, so its first blocks,
        which every chat behind the same system prompt shares, are evicted last (as the
        KV manager frees a request's blocks tail first)."""
        keys = self._keys
        for h in reversed(hashes[:self.capacity]):
            if h in keys:
                keys.move_to_end(h)
            else:
                keys[h] = None
        while len(keys) > self.capacity:
            keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


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
                 factor: float = LOAD_FACTOR, slack: int = LOAD_SLACK, max_kv_usage: float = MAX_KV_USAGE,
                 record_blocks: int = MAX_RECORD_BLOCKS, min_match: float = MIN_MATCH_FRACTION) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {num_replicas!r}")
        self.policy, self.block_size = policy, block_size
        self.factor, self.slack, self.max_kv_usage, self.min_match = factor, slack, max_kv_usage, min_match
        self.ring = HashRing(range(num_replicas))
        self.records = [BlockRecord(record_blocks) for _ in range(num_replicas)]
        self._next = 0  # round-robin's turn

    def choose(self, token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[ReplicaLoad]) -> int:
        """A live replica's index; ValueError when none is live."""
        if not any(x.alive for x in loads):
            raise ValueError("no live replica")
        if self.policy == "round-robin":
            return self._round_robin(loads)
        hashes = block_hashes(token_ids, self.block_size, cache_salt) if self.policy == "prefix" else []
        if not hashes:
            return least_loaded(loads)
        bound = load_bound(loads, self.factor, self.slack)
        key = hashes[min(len(hashes), PREFIX_BLOCKS) - 1]  # prefix_key's, without hashing twice
        room = [r for r in self.ring.walk(key)
                if loads[r].alive and loads[r].in_flight + 1 <= bound and loads[r].kv_usage < self.max_kv_usage]
        if not room:  # every replica full or busy: spread, affinity lost
            r = least_loaded(loads)
        else:
            matched = {i: self.records[i].matched(hashes) for i in room}
            best = max(matched.values())
            if best >= self.min_match * len(hashes):  # the longest match wins; ties by ring order
                r = next(i for i in room if matched[i] == best)
            else:  # a new prefix: the ring's replica, unless another has fewer requests in flight
                r = min(room, key=lambda i: loads[i].in_flight)  # min keeps the first of equals
        self.records[r].add(hashes)
        return r

    def matched(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Per replica, how many of the prompt's leading blocks its record holds."""
        hashes = block_hashes(token_ids, self.block_size, cache_salt)
        return [rec.matched(hashes) for rec in self.records]

    def forget(self, replica: int) -> None:
        """The replica died: its successor's pool starts empty, and so does its record."""
        self.records[replica].clear()

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
