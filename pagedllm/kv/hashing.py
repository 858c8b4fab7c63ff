"""Chained block hashes: a full block's key covers every token before it."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Sequence

import xxhash


def hash_block(parent: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Key of one full block: hash(parent key, its token ids, optional cache salt).

    The parent key chains the whole prefix into each block, so two blocks with the
    same tokens but different histories never collide. The salt lets tenants that
    must not see each other's cache (timing side channel) get disjoint keys.
    """
    h = xxhash.xxh3_64()
    h.update((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.intdigest()


@dataclass(slots=True)
class BlockHashes:
    """One sequence's block keys, each computed once as its tokens grow (vLLM's
    Request.block_hashes): the prefix lookup of a request waiting many steps, and the
    caching of its blocks once written, read the same list."""
    block_size: int
    salt: str | None = None
    keys: list[int] = field(default_factory=list)

    def update(self, token_ids: Sequence[int]) -> list[int]:
        """Keys of every full block of `token_ids`, which extend the tokens seen so far
        (a sequence only appends)."""
        B = self.block_size
        for i in range(len(self.keys), len(token_ids) // B):
            self.keys.append(hash_block(self.keys[-1] if self.keys else None, token_ids[i * B:(i + 1) * B], self.salt))
        return self.keys

    def prefix(self, num_tokens: int) -> BlockHashes:
        """A copy holding the keys of the first num_tokens tokens (a fork's history)."""
        return BlockHashes(self.block_size, self.salt, self.keys[:num_tokens // self.block_size])
