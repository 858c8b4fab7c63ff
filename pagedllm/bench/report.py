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


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else ""


def markdown(results: list[dict]) -> str:
    rows = ["| workload | engine | output tok/s | total tok/s | req/s | max concurrent seqs | peak KV use | mean waste | prefix hit rate |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "output_tok_s" not in r:
            if "engine" in r:
                rows.append(f"| {r.get('workload', '')} | {r['engine']} | skipped: {r.get('skipped', '')} | | | | | | |")
            continue
        rows.append("| {} | {} | {:.1f} | {:.1f} | {:.2f} | {} | {} | {} | {} |".format(
            r.get("workload", ""), r["engine"], r["output_tok_s"], r["total_tok_s"], r["requests_per_s"],
            r.get("max_concurrent_seqs", ""), _pct(r.get("peak_kv_usage")), _pct(r.get("mean_waste")),
            _pct(r.get("prefix_hit_rate"))))
    serve = [r for r in results if "ttft_ms" in r]
    if serve:
        rows += ["", "| serving run | req/s | output tok/s | mean TTFT ms | median TTFT ms | P99 TTFT ms | mean TPOT ms | mean ITL ms | hit rate |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in serve:
            rows.append("| {} | {:.2f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {} |".format(
                r.get("label", r.get("source", "")), r["request_throughput"], r["output_throughput"],
                r["ttft_ms"]["mean"], r["ttft_ms"]["median"], r["ttft_ms"]["p99"], r["tpot_ms"]["mean"],
                r["itl_ms"]["mean"], _pct(r["prefix_hit_rate"])))
    return "\n".join(rows) + "\n"


def plots(results: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    runs = [r for r in results if "output_tok_s" in r]
    if runs:  # throughput vs batch size / concurrency per engine
        fig, ax = plt.subplots(figsize=(7, 4))
        groups: dict[str, list[tuple[float, float]]] = {}
        for r in runs:
            name = r["engine"].split(" bs=")[0]
            x = r.get("batch_size") or r.get("max_concurrent_seqs") or 1
            groups.setdefault(name, []).append((x, r["output_tok_s"]))
        for name, pts in sorted(groups.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        ax.set_xlabel("batch size (static) or max concurrent sequences")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Throughput per engine")
        ax.legend(fontsize=7)
        save(fig, "throughput.png")
    # KV utilization over time per allocation policy: the policy runs, not the sweeps.
    stepped = [r for r in runs if r.get("steps") and r.get("n", 1) == 1 and "block size" not in r["engine"]
               and "prefix cache (" not in r["engine"]]
    if stepped:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in stepped:
            t0 = r["steps"][0]["t"]
            ax.plot([s["t"] - t0 for s in r["steps"]], [100 * s["usage"] for s in r["steps"]],
                    label=f"{r['engine']} ({r.get('workload', '')}, {r['stats']['num_blocks']} blocks)")
        ax.set_xlabel("seconds")
        ax.set_ylabel("KV blocks allocated (%)")
        ax.set_title("KV utilization over time")
        ax.legend(fontsize=7)
        save(fig, "kv_usage.png")
    hits = [r for r in runs if r.get("prefix_queries")]
    if hits:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r.get('workload', '')}\n{r['engine'][:24]}" for r in hits]
        ax.bar(range(len(hits)), [100 * r["prefix_hit_rate"] for r in hits])
        ax.set_xticks(range(len(hits)), labels, fontsize=6)
        ax.set_ylabel("prefix hit rate (% of prompt tokens)")
        ax.set_title("Prefix cache hit rate per workload")
        save(fig, "hit_rate.png")
    serve = [r for r in results if r.get("ttft_all_ms")]
    if serve:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in serve:
            xs = sorted(r["ttft_all_ms"])
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r.get("label", r.get("source", "")))
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT CDF")
        ax.legend(fontsize=7)
        save(fig, "latency_cdf.png")
    return written


def write_report(paths: list[str], out_dir: str) -> list[Path]:
    results = load_results(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text("# PagedLLM benchmark report\n\n" + markdown(results))
    return [md] + plots(results, out)
