"""Options declared once: a knob()'s metadata validates the config in one loop and builds its
flag, for the engine (EngineConfig) and the server (ServerOptions) alike."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.cli import build_parser
from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.knobs import Spec, spec_of
from pagedllm.server.options import ServerOptions


@pytest.mark.parametrize("config", [EngineConfig, ServerOptions])
def test_every_default_passes_its_own_knob(config):
    for f in dataclasses.fields(config):
        if spec_of(f) is not None:
            spec_of(f).check(f.name, f.default)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size must be an integer in [1, 1024], got 0"),
    ({"max_num_seqs": True}, "max_num_seqs must be an integer >= 1, got True"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be a number in (0, 1], got 0"),
    ({"scheduling_policy": "sjf"}, "scheduling_policy must be one of ('fcfs', 'lpm', 'priority'), got 'sjf'"),
    ({"batch_invariant": 1}, "batch_invariant must be True or False, got 1"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory: cannot read 'lots'"),
])
def test_engine_config_errors_name_the_field_and_what_it_accepts(kwargs, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    assert str(e.value).startswith(message)


def test_the_loop_keeps_parsed_values_and_leaves_the_rules_between_knobs_to_code():
    cfg = EngineConfig(kv_cache_memory="2GiB", dtype="bf16", kv_cache_dtype="fp8",
                       speculative_config='{"num_speculative_tokens": 2}')
    assert (cfg.kv_cache_memory, cfg.dtype, cfg.kv_cache_dtype) == (2 * 2**30, "bfloat16", "fp8_e4m3")
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"max_cpu_loras must be an integer >= max_loras \(2\), got 1"):
        EngineConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match=r"speculative_config: num_speculative_tokens must be an integer in \[1, 64\]"):
        SpeculativeConfig(num_speculative_tokens=65)


def test_server_options_validate_and_their_flags_check_as_read():
    with pytest.raises(ValueError, match="header_timeout must be a number > 0, got 0"):
        ServerOptions(header_timeout=0)
    parser = build_parser()
    args = parser.parse_args(["serve", "--shutdown-timeout", "5", "--api-key", "a", "--api-key", "b"])
    assert (args.graceful_shutdown_timeout, args.api_key) == (5.0, ["a", "b"])
    serve = parser._subparsers._group_actions[0].choices["serve"]
    with pytest.raises(argparse.ArgumentError, match="limit_concurrency must be an integer >= 1, got 0"):
        serve._get_value(next(a for a in serve._actions if a.dest == "limit_concurrency"), "0")


def test_every_server_option_but_the_log_level_is_a_serve_and_viz_flag():
    parser = build_parser()
    for command in ("serve", "viz"):
        sub = parser._subparsers._group_actions[0].choices[command]
        dests = {a.dest: a.default for a in sub._actions}
        for f in dataclasses.fields(ServerOptions):
            assert (f.name in dests and dests[f.name] == f.default) == (f.name != "log_level"), (command, f.name)


def test_a_range_in_words():
    assert Spec(int, ge=1, le=1024).describe() == "an integer in [1, 1024]"
    assert Spec(float, gt=0).describe() == "a number > 0"
    assert Spec(float, gt=0, le=3600).describe() == "a number in (0, 3600]"
    assert Spec(choices=("a", "b")).describe() == "one of ('a', 'b')"
