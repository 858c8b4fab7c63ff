"""A CPU KV pool's memory, read from the process's resident set. Each check runs in a fresh
interpreter: in the suite's long-lived workers other tests' threads (Ray's driver, servers'
loops) allocate while these run, and their pages land in the same resident count (a 200 MB rise
was seen against a 16 MB bound)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_RSS_PRELUDE = """
import gc, os, torch
from pagedllm.runtime import kv_cache
os.environ["PAGEDLLM_HUGE_PAGES"] = "0"
def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
MiB = 2**20
CPU = torch.device("cpu")
"""


def _run_alone(body: str) -> None:
    out = subprocess.run([sys.executable, "-c", _RSS_PRELUDE + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_pool_is_faulted_in_at_start_up_unless_left_lazy():
    """A CPU pool is memory the kernel zeroes page by page. By default it is all faulted in at
    start-up; with PAGEDLLM_KV_POPULATE=0 (the test suite's setting) a 256 MiB pool holds no RAM
    until written, the pages written are held, reading untouched ones gives zeros, and the
    memory goes back when the last view of the pool does."""
    _run_alone("""
        before = _rss()
        os.environ["PAGEDLLM_KV_POPULATE"] = "1"
        pool = kv_cache.allocate_pool((64, MiB), torch.float32, CPU)   # 64 blocks of 4 MiB
        assert _rss() - before >= 250 * MiB, "the pool was not faulted in at start-up"
        assert pool.abs().max().item() == 0
        del pool
        gc.collect()
        os.environ["PAGEDLLM_KV_POPULATE"] = "0"
        before = _rss()
        pool = kv_cache.allocate_pool((64, MiB), torch.float32, CPU)
        assert _rss() - before < 16 * MiB, "allocating the lazy pool wrote it"
        pool[:16] = 1.0
        assert _rss() - before >= 60 * MiB, "a written quarter of the pool holds no memory"
        assert pool[16:].abs().max().item() == 0 and pool[:16].min().item() == 1
        view = pool[20]
        del pool
        gc.collect()
        assert _rss() - before >= 60 * MiB, "a view of the pool lost the memory under it"
        del view
        gc.collect()
        assert _rss() - before < 16 * MiB, "the pool's memory was not given back"
    """)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_pools_are_faulted_in_together():
    """An engine's pools (a K and a V per layer) are faulted in on a few threads at once."""
    _run_alone("""
        os.environ["PAGEDLLM_KV_POPULATE"] = "0"
        pools = [kv_cache.allocate_pool((16, MiB), torch.float32, CPU) for _ in range(4)]  # 4 x 64 MiB
        before = _rss()
        kv_cache.populate_all(pools)
        assert _rss() - before >= 250 * MiB, "the pools were not faulted in"
        assert all(p.abs().max().item() == 0 for p in pools)
    """)
