"""`pagedllm viz` end to end: it serves the page and plays its scenario on the live engine (the
tiny model's: the subject is the blocks and the processes, not the text)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from .conftest import free_port


def test_viz_command_plays_its_scenario(tmp_path, tiny_flags):
    port = free_port()
    log = tmp_path / "viz.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "viz", "--scenario", "parallel-n4", "--no-wait",
                                 "--step-delay", "0", "--dtype", "float32", "--port", str(port), *tiny_flags],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, state = time.time() + 180, None
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                state = httpx.get(url + "/viz/state", timeout=5).json()
                if state["figures"]["forks"] >= 3 and state["figures"]["used"] == 0:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert state and state["figures"]["forks"] == 3 and state["figures"]["cow"] >= 1, (state, log.read_text())
        assert state["config"]["num_blocks"] == 32, "the scenario's pool size applies"
        assert f"open {url}/viz/" in log.read_text()
        assert httpx.get(url + "/viz/", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)


def test_open_viz_stream_does_not_hold_up_shutdown(tmp_path_factory, tiny_flags):
    import signal
    import threading

    from .conftest import start_server

    server = start_server(tmp_path_factory, *tiny_flags, name="viz-shutdown")
    got: list[str] = []

    def watch() -> None:
        with httpx.stream("GET", server.url + "/viz/events", timeout=60) as r:
            for line in r.iter_lines():
                got.append(line)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not any('"kind":"snapshot"' in x for x in got) and time.time() < deadline:
        time.sleep(0.1)
    assert got, "no snapshot on the event stream"
    t0 = time.time()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(20) == 0
    assert time.time() - t0 < 10, "an open /viz page held the shutdown up"
    t.join(5)
    assert any('"kind":"closing"' in x for x in got)
