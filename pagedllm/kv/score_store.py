"""Prompt logprobs kept beside cached blocks (what lm-eval's shared few-shot prefixes reuse),
under the block's key, within a byte cap.

An entry lives while its block stays cached and dies with it (the pool tells the store when
a key leaves the cache), so a salt that keeps a tenant's blocks apart keeps its entries
apart too. Entries cost memory outside the KV pool: 2.7 KB a block of 16 tokens at top 20,
130 KB at top 1,024. The cap bounds them: past it the least recently used entries go (their
blocks stay cached; a later hit recomputes those rows' logprobs). Plain Python: an entry is
any object with an `nbytes` (plan.PromptScores), kept without being looked into.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(slots=True)
class ScoreFigures:
    queries: int = 0        # prompt tokens of prompt-logprob requests looked up (their first has none)
    hits: int = 0           # those whose logprobs came from the cache
    entries: int = 0        # blocks keeping an entry now
    bytes: int = 0          # the entries' bytes
    cap_bytes: int = 0      # the most they may take (0: none kept)
    dropped: int = 0        # entries dropped to stay under the cap

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class ScoreStore:
    def __init__(self, cap_bytes: int, is_cached: Callable[[int], bool] = lambda key: True) -> None:
        """cap_bytes: the most the entries may take (0: keep none); is_cached(key): whether a
        block is cached under the key now (an entry is kept only beside one)."""
        if cap_bytes < 0:
            raise ValueError(f"prompt_logprobs_cache_memory must be >= 0 bytes, got {cap_bytes}")
        self.cap_bytes, self.is_cached = cap_bytes, is_cached
        self.entries: OrderedDict[int, tuple[object, int]] = OrderedDict()   # key -> (entry, bytes), LRU first
        self.bytes = 0
        self.queries = self.hits = self.dropped = 0

    def kept(self, keys: Sequence[int]) -> list:
        """The entries kept under these keys (a sequence's leading blocks), up to the first
        key without one: block b's entry holds its own tokens' prompt logprobs, b * B ..
        b * B + B - 1 (block 0 from token 1)."""
        out = []
        for key in keys:
            got = self.entries.get(key)
            if got is None:
                break
            self.entries.move_to_end(key)
            out.append(got[0])
        return out

    def keep(self, key: int, entry: object, nbytes: int | None = None) -> bool:
        """Keep `entry` (of `nbytes`, default entry.nbytes) beside the block cached under `key`;
        False if none is, if one is kept already (the first computed stays), or if it alone
        is over the cap."""
        nbytes = entry.nbytes if nbytes is None else nbytes
        if key in self.entries or nbytes > self.cap_bytes or not self.is_cached(key):
            return False
        self.entries[key] = (entry, nbytes)
        self.bytes += nbytes
        while self.bytes > self.cap_bytes:
            _, (_, n) = self.entries.popitem(last=False)
            self.bytes -= n
            self.dropped += 1
        return True

    def drop(self, key: int) -> None:
        """The block under `key` left the cache: its entry goes with it."""
        got = self.entries.pop(key, None)
        if got is not None:
            self.bytes -= got[1]

    def count(self, queried: int, served: int) -> None:
        """An admitted prompt-logprob request: prompt tokens it scores, those served from the cache."""
        self.queries += queried
        self.hits += served

    def figures(self) -> ScoreFigures:
        return ScoreFigures(self.queries, self.hits, len(self.entries), self.bytes, self.cap_bytes, self.dropped)
