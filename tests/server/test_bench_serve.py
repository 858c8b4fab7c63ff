"""`pagedllm bench serve` against the session socket_server: vLLM's summary labels, JSON keys and flags,
and the report built from the JSON it wrote."""
from __future__ import annotations

import json
import subprocess
import sys

VLLM_LABELS = [
    "============ Serving Benchmark Result ============", "Successful requests:", "Failed requests:",
    "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
    "Request throughput (req/s):", "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
    "---------------Time to First Token----------------", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "---------------Inter-token Latency----------------", "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):",
    "=" * 50,
]


def test_bench_serve_vllm_flags_labels_and_keys(socket_server, tmp_path):
    # Only vLLM's flag names: --dataset-name, --random-*, --result-dir/--result-filename, --save-result.
    cmd = [sys.executable, "-m", "pagedllm.cli", "bench", "serve", "--base-url", socket_server.url,
           "--dataset-name", "random", "--random-input-len", "12", "--random-output-len", "4", "--num-prompts", "4",
           "--request-rate", "50", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    for label in VLLM_LABELS:
        assert any(line.startswith(label) for line in lines), label
    assert "it/s]" in p.stderr or "4/4" in p.stderr, "a tqdm bar"
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["completed"] == 4 and r["failed"] == 0 and r["num_prompts"] == 4
    assert r["total_output_tokens"] == 16 and r["output_lens"] == [4] * 4
    assert r["total_token_throughput"] == (r["total_input_tokens"] + 16) / r["duration"]
    for k in ("ttft", "tpot", "itl", "e2el"):
        for s in ("mean", "median", "std", "p99"):
            assert isinstance(r[f"{s}_{k}_ms"], float), f"{s}_{k}_ms"
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"] and len(r["ttfts"]) == 4 and len(r["itls"][0]) == 3
    assert f"{r['mean_ttft_ms']:<10.2f}" in next(x for x in lines if x.startswith("Mean TTFT (ms):"))
    assert len(r["provenance"]["commit"]) in (40, len("unknown")) and r["provenance"]["threads"] >= 1
    # the report reads this run as written: its row in the serving table, its TTFT CDF
    from benchmarks.lib.report import write_report

    files = write_report([str(tmp_path / "r.json")], str(tmp_path / "report"))
    assert {p.name for p in files} == {"report.md", "serving_ttft_cdf.png"}
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"| random rate=50.0 | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | " \
           f"{r['mean_ttft_ms']:.1f} | {r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} |" in md
