"""The console script, end to end."""
from __future__ import annotations

import argparse
import dataclasses
import re
import socket
import subprocess
import sys
import time

import pytest

import pagedllm
from pagedllm.cli import _every_parser, build_parser, engine_config
from pagedllm.config import EngineConfig
from pagedllm.preflight import check_device


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_library():
    r = run("demo", "library")
    assert r.returncode == 0, r.stderr
    assert "11 blocks without sharing, 5 with paging + sharing" in r.stdout
    assert "P2->P4" in r.stdout and "12 of 12 blocks free again" in r.stdout


def test_generate_prints_answers_and_kv_report(tmp_path):
    r = run("generate", "--max-tokens", "8", "--dtype", "float32", "--kv-cache-memory", "64MiB",
            "--kv-offload-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(">>> ") == 8
    assert "KV cache report" in r.stdout and "prefix cache:" in r.stdout
    hits = r.stdout.split("prefix cache: ")[1].split("/")[0]
    assert int(hits) > 0, "the shared system prompt should hit the prefix cache"
    # The tier's line: every full block was written through; a cold tier served nothing.
    tier = re.search(r"  tier: (\d+) blocks \(.* in (\S+), 0/(\d+) prompt tokens from the tier \(tier hit rate "
                     r"0\.0%\), loaded 0, offloaded (\d+) \(backlog 0\)", r.stdout)
    assert tier, r.stdout
    assert tier[2] == str(tmp_path) and int(tier[4]) > 0 and int(tier[3]) > int(hits)


def test_kv_report_tier_line():
    """The KV report's tier line, from the figures alone; no tier, no line."""
    from dataclasses import replace

    from pagedllm.engine.kv_report import kv_report
    from pagedllm.dp.stats import zero_stats
    from pagedllm.kv import TierFigures
    from pagedllm.kv.tier_store import TierStats

    s = zero_stats(16, 46080)
    s = replace(s, kv=replace(s.kv, pool=replace(s.kv.pool, num_blocks=64), prefix_queries=1988, prefix_hits=1984))
    assert "tier:" not in kv_report(s, "/data/kv")
    store = TierStats(capacity_bytes=20 * 2**30, blocks=123, bytes=int(45.6 * 2**20), written_blocks=126,
                      write_errors=1, evicted_blocks=5, read_blocks=124, read_failures=2)
    s = replace(s, kv=replace(s.kv, tier=TierFigures("write_through", 1984, 124, 126, 3, 2, 9, store)))
    lines = kv_report(s, "/data/kv").splitlines()
    after_prefix = next(i for i, x in enumerate(lines) if x.startswith("  prefix cache:")) + 1
    assert lines[after_prefix] == (
        "  tier: 123 blocks (45.6 MiB of 20.0 GiB) in /data/kv, 1984/1988 prompt tokens from the tier (tier hit "
        "rate 99.8%), loaded 124, offloaded 126 (backlog 3), evicted 5 (tier LRU), swap-outs 2 (9 blocks), "
        "read failures 2, write errors 1")
    assert "  tier: 123 blocks (45.6 MiB of 20.0 GiB), 1984/1988" in kv_report(s)


def test_generate_rejects_bad_input_cleanly():
    r = run("generate", "Hello", "--temperature", "-1", "--dtype", "float32", "--kv-cache-memory", "64MiB")
    assert r.returncode == 2 and "temperature" in r.stderr
    r = run("generate", "Hello", "--kv-cache-memory", "lots")
    assert r.returncode == 2 and "kv_cache_memory" in r.stderr


# --- the command line itself: help, version, flags, checks before the model loads ---

def _flags(parser) -> dict:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def _subparser(parser, *path: str):
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def test_every_engine_config_field_has_one_flag_with_its_default_and_help():
    from benchmarks.__main__ import parser as benchmarks_parser

    parser = build_parser()
    for top, path in [(parser, ("generate",)), (parser, ("serve",)), (parser, ("viz",)),
                      (parser, ("bench", "throughput")), (benchmarks_parser(), ("compare",))]:
        flags = _flags(_subparser(top, *path))
        for f in dataclasses.fields(EngineConfig):
            action = flags["--" + f.name.replace("_", "-")]
            assert action.dest == f.name and action.default == f.default, (path, f.name)
            assert action.help, (path, f.name)
    # vLLM's spellings and kinds, kept as they were
    flags = _flags(_subparser(parser, "serve"))
    assert "--no-enable-prefix-caching" in flags
    assert flags["--dtype"].choices == ["auto", "float32", "bfloat16", "float16"]
    assert flags["--allocation"].choices == ["paged", "reserve-max"]
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--batch-invariant", "--enforce-eager",
                              "--kv-cache-memory", "64MiB", "--num-threads", "2", "--max-num-partial-prefills", "2",
                              "--long-prefill-token-threshold", "100", "--block-size", "32"])
    cfg = engine_config(args)
    assert (cfg.enable_prefix_caching, cfg.batch_invariant, cfg.enforce_eager) == (False, True, True)
    assert (cfg.kv_cache_memory, cfg.num_threads, cfg.block_size) == (64 * 2**20, 2, 32)
    assert (cfg.max_num_partial_prefills, cfg.long_prefill_token_threshold) == (2, 100)
    assert engine_config(parser.parse_args(["serve"])) == EngineConfig()


def _help_entries(text: str) -> dict[str, str]:
    """Option string -> its help text, from argparse's two-column layout."""
    entries, current = {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -"):
            current = stripped.split()[0].rstrip(",")
            entries[current] = stripped
        elif current and line.startswith("      "):
            entries[current] += " " + stripped
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["viz"], ["bench", "throughput"]])
def test_help_shows_every_default(command):
    r = run(*command, "--help")
    assert r.returncode == 0, r.stderr
    entries = _help_entries(r.stdout)
    assert "--block-size" in entries and "--max-num-seqs" in entries
    for flag, text in entries.items():
        if flag not in ("-h", "--help"):
            assert "default" in text, f"{flag} shows no default: {text}"
    assert "(default: 16)" in entries["--block-size"] and "(default: 256)" in entries["--max-num-seqs"]


def test_every_flag_of_every_command_has_help_with_its_default():
    parser = build_parser()
    missing = []
    for p in _every_parser(parser):
        formatter = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            text = formatter._get_help_string(a) if a.help else ""
            if "default" not in text and a.option_strings:  # positionals: required, no default
                missing.append(f"{p.prog} {a.option_strings[0]}")
            elif not a.help:
                missing.append(f"{p.prog} {a.dest}")
    assert not missing, missing


def test_version_and_log_level_after_the_subcommand():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pagedllm {pagedllm.__version__}"
    parser = build_parser()
    assert parser.parse_args(["demo", "library"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "debug", "demo", "library"]).log_level == "DEBUG"
    assert parser.parse_args(["demo", "library", "--log-level", "warning"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "debug", "bench", "latency", "--log-level", "error"]
                             ).log_level == "ERROR"
    r = run("demo", "library", "--log-level", "loud")
    assert r.returncode == 2 and "--log-level" in r.stderr


def test_serve_takes_the_model_as_a_positional_argument():
    parser = build_parser()
    args = parser.parse_args(["serve", "models/Qwen2.5-0.5B-Instruct", "--port", "8001"])
    assert args.model_tag == "models/Qwen2.5-0.5B-Instruct" and args.port == 8001
    assert parser.parse_args(["serve", "--model", "m.gguf"]).model_tag is None
    r = run("serve", "a.gguf", "--model", "b.gguf")
    assert r.returncode == 2 and "two models" in r.stderr


def test_bad_kv_budget_fails_before_the_model_loads():
    t0 = time.monotonic()
    r = run("serve", "--kv-cache-memory", "lots")
    assert r.returncode == 2 and "kv_cache_memory" in r.stderr
    assert time.monotonic() - t0 < 10, "checked at parse time, not after loading the model"


def test_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = run("serve", "--port", str(port), "--model", "/nonexistent/model.gguf")
        elapsed = time.monotonic() - t0
    # The model path does not exist either: failing on the port proves the port came first.
    assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr and "--port" in r.stderr, r.stderr
    assert elapsed < 10, f"took {elapsed:.1f} s: the port should be checked before torch and the model load"


def test_device_check():
    check_device("auto")
    check_device("cpu")
    with pytest.raises(ValueError, match="device"):
        check_device("tpu")
    with pytest.raises(ValueError, match="cuda:99"):
        check_device("cuda:99")


def test_log_lines_carry_timestamps():
    # A stand-in command that logs one line, through main()'s logging set-up.
    code = ("import logging, sys, pagedllm.cli as c; "
            "c.cmd_demo = lambda a: logging.getLogger('probe').warning('hello') or 0; "
            "sys.exit(c.main(['demo', 'library']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING probe: hello", r.stderr), r.stderr
