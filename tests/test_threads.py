"""Thread count: physical cores by default, the flag and OMP_NUM_THREADS honoured, and
fewer threads while another process keeps our cores busy."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pagedllm.runtime import threads as th


class FakeClock:
    """Drives the governor: wall time, CPU time of everyone on our CPUs, and our own."""

    def __init__(self, monkeypatch):
        self.wall = self.busy = self.ours = 0.0
        monkeypatch.setattr(th.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(th.time, "process_time", lambda: self.ours)
        monkeypatch.setattr(th, "_busy_seconds", lambda cpus: self.busy)

    def advance(self, seconds: float, ours: float, others: float) -> None:
        self.wall += seconds
        self.ours += seconds * ours
        self.busy += seconds * (ours + others)


def test_governor_follows_the_neighbour(monkeypatch):
    clock = FakeClock(monkeypatch)
    before = torch.get_num_threads()
    try:
        gov = th.ThreadGovernor(2, interval=0.5, cpus=[0, 1])
        for _ in range(4):  # quiet: stays at 2
            clock.advance(0.5, ours=2.0, others=0.05)
            gov.tick()
        assert gov.threads == 2
        clock.advance(0.5, ours=1.0, others=1.0)  # a neighbour takes a core: one reading is not enough
        gov.tick()
        assert gov.threads == 2
        clock.advance(0.5, ours=1.0, others=1.0)
        gov.tick()
        assert gov.threads == 1 and torch.get_num_threads() == 1
        for _ in range(2):  # the neighbour leaves
            clock.advance(0.5, ours=1.0, others=0.0)
            gov.tick()
        assert gov.threads == 2 and torch.get_num_threads() == 2 and gov.changes == 2
        clock.advance(0.1, ours=1.0, others=2.0)  # within an interval: no reading at all
        gov.tick()
        assert gov.threads == 2
    finally:
        torch.set_num_threads(before)


def _neighbour(cpu: int, nice: int) -> subprocess.Popen:
    def pin() -> None:
        os.sched_setaffinity(0, {cpu})
        os.nice(nice)
    # A loop in user space: a niced process's system calls count as system time, not nice.
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)


@pytest.mark.skipif(len(th.allowed_cpus()) < 2 or th._busy_seconds([0]) is None,
                    reason="needs two CPUs and /proc/stat")
@pytest.mark.parametrize("nice", [0, 19])
def test_governor_sees_a_real_busy_process_but_not_a_niced_one(nice):
    """A busy loop pinned to one of two watched CPUs: the governor drops to one thread; the same
    loop at nice 19 yields its core to us whenever we want it, and the governor keeps two."""
    cpus = th.allowed_cpus()[:2]
    before = torch.get_num_threads()
    busy = _neighbour(cpus[1], nice)
    try:
        gov = th.ThreadGovernor(2, interval=0.3, cpus=cpus)
        deadline = time.monotonic() + (10 if nice == 0 else 2)
        while gov.threads == 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            gov.tick()
        assert gov.threads == (1 if nice == 0 else 2)
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(before)
