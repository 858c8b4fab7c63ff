"""A benchmark's helper process (a server, a gateway): its output in a log file, up once a
check passes, stopped politely."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable

import httpx


class LoggedProcess:
    def __init__(self, label: str, argv: list[str]) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix=f"{label}-", suffix=".log")
        with os.fdopen(fd, "w") as log:  # the process writes on through its own copy
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `ready` (an HTTP check: its connection and parse errors count as not yet)
        until it holds; RuntimeError with the log's tail if the process exits or time runs
        out, and the process stopped."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what}: exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            try:
                if ready():
                    return
            except (httpx.HTTPError, json.JSONDecodeError, KeyError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{what}: not within {timeout:.0f} s:\n{self.text()[-3000:]}")

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
