"""Chained block hashes: a full block's key covers every token before it."""
from __future__ import annotations

from array import array
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

