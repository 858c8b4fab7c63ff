"""The SGLang Model Gateway (PyPI sglang-router) as a subprocess in front of running workers,
for the gateway test and benchmarks/gateway_vs_dp.py."""
from __future__ import annotations

import sys

import httpx

from pagedllm.util import free_port
from .process import LoggedProcess


class Gateway(LoggedProcess):
    """`python -m sglang_router.launch_router` on 127.0.0.1, up once it has registered every
    worker as healthy (it listens before it has asked them for /server_info and /model_info)."""

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware", timeout: float = 60) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__("sglang-router", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
            # its Prometheus listener, on a free loopback port rather than 0.0.0.0:29000
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--shutdown-grace-period-secs", "1"])

        def registered() -> bool:
            workers = httpx.get(self.url + "/workers", timeout=2).json()["workers"]
            return sum(w["is_healthy"] for w in workers) == len(worker_urls)
        self.wait_until(registered, timeout, f"the gateway registering {len(worker_urls)} workers")

    def stop(self, timeout: float = 15) -> None:
        super().stop(timeout)
