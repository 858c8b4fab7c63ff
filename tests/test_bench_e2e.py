"""The benchmarks' `compare` (ours against HF generate) and `memory` run end to end through their
entry point (python -m benchmarks) on tiny workloads, with no warm-up pass; the report is built
from the JSON they wrote; every result file records where it was measured. On the tiny model: the
subject is the benchmarks' plumbing, not the figures."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.__main__ import main as benchmarks
from benchmarks.lib.report import write_report
from pagedllm.cli import main

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "64MiB"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def compare_json(out_dir, tiny_model) -> Path:
    """Three random prompts of 4..12 tokens, 2..6 output tokens each; HF in static batches of
    2 (left padding, a last batch of one), each engine in its own process."""
    out = out_dir / "compare.json"
    assert benchmarks(["compare", "--workload", "random", "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "4", "--range-ratio", "0.5", *ENGINE, "--model", tiny_model, "--hf-batch-sizes", "2",
                 "--skip", "variants,vllm,openvino,openvino-u8,hf-batch,llama.cpp", "--warmup", "0", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def memory_json(out_dir, tiny_model) -> Path:
    """Paged vs reserve-max, prefix sharing on the three shared-prefix workloads, n = 4,
    beam search k = 2, 4, 6."""
    out = out_dir / "memory.json"
    assert benchmarks(["memory", "--num-prompts", "3", "--max-output-len", "3", "--max-prompt-len", "48",
                 "--truncate-prompts", "--system-tokens", "40", "--doc-tokens", "48", "--max-model-len", "512",
                 *ENGINE, "--model", tiny_model, "--parts", "reserve,prefix,n,beam", "--out", str(out)]) == 0
    return out


def _provenance_ok(p: dict) -> None:
    assert p["commit"] == "unknown" or re.fullmatch(r"[0-9a-f]{40}", p["commit"]), p["commit"]
    assert p["torch"] and isinstance(p["threads"], int) and p["threads"] >= 1


def test_compare_against_hf_generates_the_same_tokens(compare_json):
    r = json.loads(compare_json.read_text())
    assert {"workload", "workload_options", "workload_summary", "headline", "results", "provenance"} <= set(r)
    _provenance_ok(r["provenance"])
    runs = {x["engine"]: x for x in r["results"]}
    assert set(runs) == {"pagedllm", "hf-transformers bs=2"}, runs
    ours, hf = runs["pagedllm"], runs["hf-transformers bs=2"]
    ws = r["workload_summary"]
    assert ws["num_requests"] == 3 and ws["max_prompt_len"] > ws["mean_prompt_len"], "HF pads a batch"
    # both count what they generated; the requested total is the bar for each
    expected = round(ws["mean_output_len"] * ws["num_requests"])
    assert ours["output_tokens"] == hf["output_tokens"] == expected
    assert ours["prompt_tokens"] == hf["prompt_tokens"]
    for x in (ours, hf):
        assert x["num_requests"] == 3 and x["output_tok_s"] > 0 and x["elapsed_s"] > 0
    assert ours["cold_over_warm"] is None, "--warmup 0: one pass, the cold one"
    assert r["headline"]["vs_hf_static_best_engine"] == "hf-transformers bs=2"
    assert r["headline"]["vs_hf_static_best"] == pytest.approx(ours["output_tok_s"] / hf["output_tok_s"])


def test_memory_analysis_tiny(memory_json):
    r = json.loads(memory_json.read_text())
    assert {"options", "engine", "paged_vs_reserve", "prefix_sharing", "parallel_sampling", "results",
            "provenance"} <= set(r)
    _provenance_ok(r["provenance"])
    pv = r["paged_vs_reserve"]
    assert pv["paged"]["output_tokens"] == pv["reserve_max"]["output_tokens"] > 0
    # under one KV budget, reserving max_model_len per sequence never runs more sequences at once
    assert pv["paged"]["max_concurrent_seqs"] >= pv["reserve_max"]["max_concurrent_seqs"] >= 1
    assert pv["concurrency_ratio"] >= 1
    assert [x["workload"] for x in r["prefix_sharing"]] == ["chat-shared-system", "rag-doc-qa", "batch-eval"]
    for x in r["prefix_sharing"]:
        assert x["prefix_hit_rate"] > 0 and x["shared_prefix_blocks"] >= 1, x["workload"]
        assert x["measured_saved_bytes"] == x["measured_saved_blocks"] * x["bytes_per_block"]
    ps = r["parallel_sampling"]
    assert ps["n"] == 4 and ps["max_blocks_saved_frac"] > 0, "n samples share their prompt's blocks"
    beams = r["beam_sharing"]
    assert [(x["workload"], x["beam_width"]) for x in beams] == [
        (w, k) for w in ("sharegpt", "short-instructions") for k in (2, 4, 6)]
    for x in beams:  # k beams of a prompt share its blocks: fewer blocks than k copies
        assert 0 < x["mean_blocks_saved_frac"] < 1 and x["peak_blocks_used"] < x["peak_blocks_without_sharing"]
        assert x["output_tokens"] > 0
    assert len(r["results"]) == 2 + 3 + 1 + 6 and all("steps" in x for x in r["results"][:6])


def test_report_from_real_results(compare_json, memory_json, tmp_path):
    files = write_report([str(compare_json), str(memory_json)], str(tmp_path / "report"))
    assert {p.name for p in files} == {"report.md", "compare.png", "memory.png"}
    assert all(p.stat().st_size > 1000 for p in files if p.suffix == ".png")
    md = (tmp_path / "report" / "report.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
    engines = [ln.split(" | ")[1] for ln in rows[1:]]
    assert engines[:2] == ["pagedllm", "hf-transformers bs=2"]
    assert {"paged", "reserve-max", "paged n=4"} <= set(engines)
    assert sum(e.startswith("paged + prefix cache") for e in engines) == 3
    ours = json.loads(compare_json.read_text())["results"][0]
    assert f"| random | pagedllm | {ours['output_tok_s']:.1f} |" in md


@pytest.mark.parametrize("command", [
    ["bench", "throughput", "--workload", "random", "--num-prompts", "2", "--input-len", "6", "--output-len", "2",
     *ENGINE, "--warmup", "0"],
    ["attention", "--batches", "1", "--contexts", "32", "--no-reference"]])
def test_every_result_file_records_commit_torch_and_threads(command, tmp_path):
    """The other writers (latency: test_bench.py, serve: tests/server/test_bench_serve.py)."""
    out = tmp_path / "r.json"
    run = main if command[0] == "bench" else benchmarks
    assert run([*command, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    _provenance_ok(r["provenance"])
    if command[1] == "throughput":
        assert r["output_tokens"] == 4 and r["cold_over_warm"] is None, "--warmup 0: the cold pass alone"


def test_result_file_commit_is_unknown_outside_git(monkeypatch, tmp_path):
    from pagedllm.bench import provenance

    monkeypatch.setattr(provenance, "_git", lambda *a: "")  # what git answers outside a checkout
    provenance.save_result({"results": []}, str(tmp_path / "r.json"))
    p = json.loads((tmp_path / "r.json").read_text())["provenance"]
    assert p["commit"] == "unknown" and p["dirty"] is False
    _provenance_ok(p)
