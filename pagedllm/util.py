"""Small helpers every layer shares (no torch: the KV manager imports it)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; another process may take it first)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags from /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return None


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, e.g. the blocks that hold a tokens: cdiv(a, block_size)."""
    return -(-a // b)


def cache_root() -> Path:
    """Where converted models, the compiled CPU kernels and benchmark venvs are kept:
    $PAGEDLLM_CACHE, else $XDG_CACHE_HOME/pagedllm (~/.cache/pagedllm)."""
    base = os.environ.get("PAGEDLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    return Path(base)


def json_object(value, name: str) -> dict:
    """A JSON object given as itself or as its text; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e.msg} at character {e.pos}): {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def release_freed_heap() -> None:
    """Hand the heap that loading freed back to the OS (glibc's malloc_trim). Loading parses JSON,
    reads checkpoints and converts blocks through short-lived buffers; glibc keeps the freed
    pages, and the process looks that much bigger for its whole life: 520 MiB of Gemma 3 270M's
    1,274 MiB after load. Elsewhere than glibc, nothing."""
    import ctypes
    import gc

    gc.collect()  # cycles first: their buffers are freed heap too
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: libc's where it is glibc
    if trim is not None:
        trim(0)
