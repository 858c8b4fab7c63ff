"""Real `pagedllm serve` processes on 127.0.0.1 with the default model."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
from pagedllm.util import free_port

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Server:
    """A real `pagedllm serve` process on 127.0.0.1: for what needs a socket (slow clients,
    disconnects, shutdown, other programs as clients). The same client helpers as InProcessServer."""
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 120, **kw})

    def openai(self, api_key: str = "none", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, **kw)




def start_server(tmp_path_factory, *extra: str, name: str = "server") -> Server:
    port = free_port()
    log_path = str(tmp_path_factory.mktemp(name) / "server.log")
    args = [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port), "--dtype", "float32",
            "--kv-cache-memory", "160MiB", "--max-model-len", "1024", "--log-interval", "2", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not come up:\n{server.log()}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()


@pytest.fixture(scope="session")
def server():
    """The default server, in process (httpx.ASGITransport): the API's answers need no socket."""
    from .inproc import serve_in_process

    s = serve_in_process()
    yield s
    s.close()


@pytest.fixture(scope="session")
def fp32_server():
    """The default server in float32, in process: for answers held to HF transformers' float32."""
    from .inproc import serve_in_process

    s = serve_in_process("--dtype", "float32")
    yield s
    s.close()


@pytest.fixture(scope="session")
def tiny_server(tiny_flags):
    """The tiny model's server, in process: for what the model's text does not matter to."""
    from .inproc import serve_in_process

    s = serve_in_process(*tiny_flags)
    yield s
    s.close()


@pytest.fixture(scope="session")
def tool_server():
    """The default model's server reading tool calls (--enable-auto-tool-choice --tool-call-parser
    hermes), in process: what the chat, Responses and Messages APIs' tool tests share."""
    from .inproc import serve_in_process

    s = serve_in_process("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.close()


@pytest.fixture(scope="session")
def socket_server(tmp_path_factory):
    """The default server as a process of its own, for what needs a socket."""
    s = start_server(tmp_path_factory)
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def keyed_server(tiny_flags):
    """Keys, on the tiny model's server: what is checked is who may ask, not the answers."""
    from .inproc import serve_in_process

    s = serve_in_process(*tiny_flags, "--api-key", "alice-key", "--api-key", "bob-key")
    yield s
    s.close()


def metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = server.client().get("/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if not sample.labels.get("le"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def metric_sample(server, name: str, **labels: str) -> float:
    """One labelled sample, e.g. metric_sample(url, "pagedllm:request_success_total", finished_reason="abort").

    `metrics()` sums a family over its labels; this reads only the samples whose labels include `labels`
    (0.0 when none exists yet, as a counter that has never moved is not exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = server.client().get("/metrics", timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
