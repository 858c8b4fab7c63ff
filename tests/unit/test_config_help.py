"""Flag help says what a knob does, never how fast it measured: figures go stale, and live in
BENCHMARKS.md (which help may point to)."""
from __future__ import annotations

import dataclasses
import re

from pagedllm.cli import build_parser
from pagedllm.config import EngineConfig

FIGURE = re.compile(r"\d+(\.\d+)?\s*x\b|\d+(\.\d+)?x faster|measured|\d+(\.\d+)?\s*(ms|tok/s)\b|section \d+")


def test_engine_flags_cite_no_measured_figures():
    for f in dataclasses.fields(EngineConfig):
        text = f.metadata["help"]
        assert not FIGURE.search(text), f"--{f.name.replace('_', '-')}: {FIGURE.search(text).group(0)!r} in its help"


def test_no_subcommand_help_cites_measured_figures():
    def walk(parser):
        for action in parser._actions:
            if action.help and FIGURE.search(action.help):
                raise AssertionError(f"{parser.prog} {action.option_strings}: {action.help!r}")
            for sub in (action.choices or {}).values() if hasattr(action, "choices") and isinstance(
                    action.choices, dict) else ():
                walk(sub)
    walk(build_parser())


def test_priority_scheduling_and_the_score_cache_cap_are_flags():
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority",
                                      "--prompt-logprobs-cache-memory", "8MiB"])
    assert (args.scheduling_policy, args.prompt_logprobs_cache_memory) == ("priority", 8 * 2**20)
    assert EngineConfig(prompt_logprobs_cache_memory="0").prompt_logprobs_cache_memory == 0
