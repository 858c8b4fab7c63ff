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


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def busy_cpu_seconds(cpus: list[int]) -> float | None:
    """CPU time spent on these CPUs by anyone (user, system, irq, steal), from /proc/stat.

    Time of niced processes ("nice") counts only when we are niced ourselves: a process of
    lower priority than ours gives us its core whenever we want it (a `nice -n 19` compile
    beside a 2-thread engine left it at full speed, while dropping to one thread for it cost
    40 %), so it is no reason to run on fewer threads. Its system calls still count: the kernel
    books them as system time, whoever makes them."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    want = {f"cpu{c}" for c in cpus}
    count_nice = os.getpriority(os.PRIO_PROCESS, 0) > 0
    ticks = 0
    for ln in lines:
        parts = ln.split()
        if parts and parts[0] in want:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, parts[1:9])
            ticks += user + system + irq + softirq + steal + (nice if count_nice else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


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


def spare_final_collections() -> None:
    """For a process of ours that ends cleanly (a command, a tensor-parallel rank, a replica), at
    its very end: every live object moved out of the collector's sight (gc.freeze), so that the
    interpreter's last collections do not walk the ~600k objects torch and transformers made
    (0.4-0.5 s of every such process's exit on 2 cores). Modules are still torn down and their
    objects freed by reference counting; what is left in cycles is freed by the OS with the
    process. Never in a process that goes on (a test calling main()): it would keep garbage."""
    import gc

    gc.freeze()
