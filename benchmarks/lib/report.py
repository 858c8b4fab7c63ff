"""`pagedllm bench report`: result JSON -> a Markdown table and PNG plots."""
from __future__ import annotations

import json
import os
from pathlib import Path


def load_results(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        items = data["results"] if isinstance(data, dict) and "results" in data else data
        for r in items if isinstance(items, list) else [items]:
            r.setdefault("source", os.path.basename(p))
            out.append(r)
    return out


def _num(x, fmt: str) -> str:
    """A figure some runs do not record (beam-search runs count only their beams' tokens)."""
    return fmt.format(x) if isinstance(x, (int, float)) else ""


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else ""


def markdown(results: list[dict]) -> str:
    rows = ["| workload | engine | output tok/s | total tok/s | req/s | max concurrent seqs | peak KV use | mean waste | prefix hit rate |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not isinstance(r.get("output_tok_s"), (int, float)) or "engine" not in r:  # not an engine run
            if "engine" in r:
                rows.append(f"| {r.get('workload', '')} | {r['engine']} | skipped: {r.get('skipped', '')} | | | | | | |")
            continue
        rows.append("| {} | {} | {:.1f} | {} | {} | {} | {} | {} | {} |".format(
            r.get("workload", ""), r["engine"], r["output_tok_s"], _num(r.get("total_tok_s"), "{:.1f}"),
            _num(r.get("requests_per_s"), "{:.2f}"),
            r.get("max_concurrent_seqs", ""), _pct(r.get("peak_kv_usage")), _pct(r.get("mean_waste")),
            _pct(r.get("prefix_hit_rate"))))
    serve = [_serve_keys(r) for r in results if "mean_ttft_ms" in r or "ttft_ms" in r]
    if serve:
        rows += ["", "| serving run | req/s | output tok/s | mean TTFT ms | median TTFT ms | P99 TTFT ms | mean TPOT ms | mean ITL ms | hit rate |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in serve:  # a data-parallel layout records only some of vLLM's keys
            figures = [_num(r.get("request_throughput"), "{:.2f}"),
                       _num(r.get("output_throughput", r.get("output_tok_s")), "{:.1f}")]
            figures += [_num(r.get(k), "{:.1f}") for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                                             "mean_tpot_ms", "mean_itl_ms")]
            rows.append(f"| {_serve_label(r)} | {' | '.join(figures)} | {_pct(r.get('prefix_hit_rate'))} |")
    return "\n".join(rows) + "\n"


def _serve_label(r: dict) -> str:
    if r.get("label"):
        return r["label"]
    if "server" in r and "client" in r:  # serve_vs_vllm.py's sweep
        return f"{r['server']} server, {r['client']} client, {r.get('request_rate', '')} req/s"
    return r.get("source", "")


def _serve_keys(r: dict) -> dict:
    """vLLM's flat serve keys (mean_ttft_ms, ...), also for results saved before we wrote them
    (nested ttft_ms.mean, ttft_all_ms)."""
    if "ttft_ms" not in r:
        return r
    flat = {f"{s}_{k}_ms": r[f"{k}_ms"][s] for k in ("ttft", "tpot", "itl") for s in ("mean", "median", "p99")}
    return {**r, **flat, "ttfts": [x / 1000 for x in r.get("ttft_all_ms", [])]}


def write_report(paths: list[str], out_dir: str) -> list[Path]:
    results = load_results(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text("# PagedLLM benchmark report\n\n" + markdown(results))
    # One PNG per experiment (bench/plots.py), from each file as written.
    from .plots import plot_files

    files = [(Path(p).stem, json.loads(Path(p).read_text())) for p in paths]
    return [md] + plot_files(files, out)
