"""Small arithmetic every layer shares (no torch: the KV manager imports it)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, e.g. the blocks that hold a tokens: cdiv(a, block_size)."""
    return -(-a // b)
