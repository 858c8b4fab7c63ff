"""The console script, end to end."""
from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_library():
    r = run("demo", "library")
    assert r.returncode == 0, r.stderr
    assert "11 blocks without sharing, 5 with paging + sharing" in r.stdout
    assert "P2->P4" in r.stdout and "12 of 12 blocks free again" in r.stdout


def test_generate_prints_answers_and_kv_report():
    r = run("generate", "--max-tokens", "8", "--dtype", "float32", "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(">>> ") == 8
    assert "KV cache report" in r.stdout and "prefix cache:" in r.stdout
    hits = r.stdout.split("prefix cache: ")[1].split("/")[0]
    assert int(hits) > 0, "the shared system prompt should hit the prefix cache"


def test_generate_rejects_bad_input_cleanly():
    r = run("generate", "Hello", "--temperature", "-1", "--dtype", "float32", "--kv-cache-memory", "64MiB")
    assert r.returncode == 2 and "temperature" in r.stderr
    r = run("generate", "Hello", "--kv-cache-memory", "lots")
    assert r.returncode == 2 and "kv_cache_memory" in r.stderr
