"""Small arithmetic every layer shares (no torch: the KV manager imports it)."""
from __future__ import annotations


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; another process may take it first)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, e.g. the blocks that hold a tokens: cdiv(a, block_size)."""
    return -(-a // b)
