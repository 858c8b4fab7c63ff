"""release_freed_heap (util.py), which every engine calls once it has loaded: the heap that
loading freed goes back to the OS instead of staying in the process's resident memory."""
from __future__ import annotations

import ctypes

import pytest

from pagedllm.util import release_freed_heap


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(getattr(ctypes.CDLL(None), "malloc_trim", None) is None, reason="not glibc")
def test_freed_heap_goes_back_to_the_os():
    # ~200 MiB of small objects (below glibc's mmap threshold: they live on the heap, as a
    # tokenizer's JSON or a checkpoint's parse does), one kept at the end so the heap's top
    # stays in use and only a trim (not the automatic top release) can return the rest
    junk = [bytes(1000) for _ in range(200_000)]
    keep = bytes(1000)
    before = resident_mib()
    del junk
    freed = resident_mib()
    release_freed_heap()
    after = resident_mib()
    assert before - after > 150, (before, freed, after)
    assert keep
