"""Thread count: physical cores by default, the flag and OMP_NUM_THREADS honoured, and
fewer threads while another process keeps our cores busy."""
from __future__ import annotations


import pytest

from pagedllm.runtime import threads as th


def test_thread_count_sources(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert th.resolve_num_threads(3) == (3, "--num-threads")
    n, source = th.resolve_num_threads(None)
    assert source == "physical cores" and 1 <= n <= len(th.allowed_cpus())
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert th.resolve_num_threads(None) == (5, "OMP_NUM_THREADS")
    assert th.resolve_num_threads(2) == (2, "--num-threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        th.resolve_num_threads(None)


def test_num_threads_validated():
    from pagedllm import EngineConfig

    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)
