"""The unit tier: no model loaded, no server started, no process spawned. Enforced here, so a
test that needs any of them fails with a message saying where it belongs."""
from __future__ import annotations

import subprocess

import pytest


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"tests/unit {what}: this test belongs with the model tests (tests/)")
    return refused


@pytest.fixture(autouse=True)
def no_model_server_or_process(monkeypatch):
    from pagedllm.runtime.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "__init__", _refuse("loads no model"))
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("spawns no process"))
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", _refuse("starts no server"))
