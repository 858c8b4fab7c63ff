"""How many threads the CPU runs on, and running on fewer while a neighbour is busy.

Default: one thread per physical core this process may use (hyperthreads share a core's
vector units, so a second thread per core only adds synchronisation). --num-threads or
OMP_NUM_THREADS override it.

Every matmul and attention call ends in a barrier: all threads must finish their share.
When another process keeps one of our cores busy, the thread on that core gets only
time slices and every barrier waits for it: measured here, a `yes > /dev/null` beside a
2-thread engine made it ~20x slower, while one thread lost only half. So the governor
watches how much of our CPUs other processes use (/proc/stat less our own CPU time)
and sets the thread count to the cores left free, going back up when they free up.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from ..util import allowed_cpus
from ..util import busy_cpu_seconds as _busy_seconds

logger = logging.getLogger(__name__)


def physical_cores(cpus: list[int] | None = None) -> int:
    """Distinct physical cores among the CPUs this process may run on."""
    cpus = allowed_cpus() if cpus is None else cpus
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(c)))  # no topology: count logical CPUs
    return max(1, len(cores))


def resolve_num_threads(requested: int | None) -> tuple[int, str]:
    """(threads, where the number came from)."""
    if requested is not None:
        return requested, "--num-threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env.split(",")[0])
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {env!r}")
        return n, "OMP_NUM_THREADS"
    return physical_cores(), "physical cores"


class ThreadGovernor:
    """Call tick() once per step. Every `interval` seconds it measures the CPU time other
    processes took on our CPUs; when the cores they leave free stay below the current
    thread count for two readings in a row it drops threads (never below 1), and raises
    them again the same way, up to the configured count."""

    def __init__(self, max_threads: int, interval: float = 0.5, enabled: bool = True,
                 cpus: list[int] | None = None) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval = interval
        self.cpus = allowed_cpus() if cpus is None else cpus
        self.enabled = enabled and _busy_seconds(self.cpus) is not None
        self._last = self._reading()
        self._pending: int | None = None
        self.changes = 0
        torch.set_num_threads(max_threads)

    def _reading(self) -> tuple[float, float, float]:
        return time.monotonic(), _busy_seconds(self.cpus) or 0.0, time.process_time()

    def tick(self) -> None:
        if not self.enabled or time.monotonic() - self._last[0] < self.interval:
            return
        now = self._reading()
        wall = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        free = len(self.cpus) - others
        target = max(1, min(self.max_threads, int(free + 0.25)))
        if target == self.threads:
            self._pending = None
            return
        if self._pending != target:  # wait for a second reading: one busy interval is noise
            self._pending = target
            return
        logger.info("other processes use %.1f of %d CPUs: running on %d threads (was %d; the attention keeps its "
                    "plan for %d and our matmul kernels sum in a fixed order, but a matmul given to oneDNN may add "
                    "in another order and flip a near-tie: --batch-invariant pins every sum, "
                    "PAGEDLLM_ADAPT_THREADS=0 the count)",
                    others, len(self.cpus), target, self.threads, self.max_threads)
        self.threads = target
        self._pending = None
        self.changes += 1
        torch.set_num_threads(target)
