"""A real redis-server (Debian's, `scripts/install.sh` installs it) on a loopback port, for the
shared KV tier's tests and benchmarks: no persistence, bounded memory, evicting as a cache."""
from __future__ import annotations

import shutil
import tempfile

from pagedllm.util import free_port

from .process import LoggedProcess


class RedisServer:
    def __init__(self, maxmemory: str = "1gb") -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server; "
                                    "scripts/install.sh does it)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="pagedllm-redis-")
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = LoggedProcess("redis", [
            exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self.dir, "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"])
        self.proc.wait_until(self._answers, 10, f"redis-server on port {self.port}")

    def _answers(self) -> bool:
        import redis

        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.ConnectionError:
            return False

    def client(self):
        import redis

        return redis.Redis(port=self.port)

    def stop(self) -> None:
        self.proc.stop(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
