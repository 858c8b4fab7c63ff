"""lm-evaluation-harness on a multiple-choice task, as evaluators run it (issue 25): lm-eval's
`local-completions` against each server, 8 requests in flight, batch size 1, and lm-eval's own
`hf` model, side by side in one run.

    python -m benchmarks lm_eval_mc --setup-vllm --out benchmarks/results/lm_eval_mc.json

Workload: 240 questions of MMLU's shape (2-4 sentences and a question line, four lettered answers;
benchmarks/lib/harness.py writes them from --seed, nothing is downloaded), each behind the same
5-shot prefix (fewshot sampler first_n, ~650 tokens with SmolLM2's tokenizer): 960 loglikelihood
requests of ~780 tokens, each an echo + logprobs=1 + max_tokens=1 completion over token ids. The
questions mean little; the accuracy shows the engines agree, not what the model knows.

Engines, each in a process of its own, one at a time, same bf16 weights (the default model's
dequantized HF directory) and KV budget (--kv-cache-memory; vLLM's VLLM_CPU_KVCACHE_SPACE):
`pagedllm serve` with prefix caching, `pagedllm serve --no-enable-prefix-caching`, `vllm serve`
(vLLM's CPU backend from its own venv, --setup-vllm creates it) and lm-eval's `hf` model (no
server, --hf-batch-size). lm-eval itself runs in a process of its own (benchmarks/lib/harness.py):
one unrelated warm-up request, then the timed evaluation. Per engine: wall time, accuracy, the
prompt tokens lm-eval sent and those the engine computed (ours: /metrics computed_prompt_tokens;
vLLM: prompt_tokens - prefix_cache_hits; hf: the tokens of its forward passes, padding included),
the prefix hit rate, agreement with the reference (hf when it ran), and ratios to vllm serve.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib.data_parallel import ServeProcess, threads_used
from benchmarks.lib.harness import write_mc_task
from pagedllm.bench.provenance import provenance, save_result
from benchmarks.lib.vllm_baseline import VLLM_VERSION, VllmServer, vllm_python
from pagedllm.config import parse_bytes
from pagedllm.loader import resolve_model_dir
from pagedllm.util import free_port

MODEL = "SmolLM2-135M-Instruct"
ENGINES = {"pagedllm": "pagedllm serve, prefix caching", "pagedllm-no-prefix": "pagedllm serve, no prefix caching",
           "vllm": f"vllm serve (vllm-cpu {VLLM_VERSION})", "hf": "lm-eval hf (hf-transformers)"}


def evaluate(spec: dict, timeout: float) -> dict:
    """One lm-eval run in a process of its own (benchmarks/lib/harness.py)."""
    with tempfile.TemporaryDirectory() as d:
        spec_path, out = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        p = subprocess.run([sys.executable, "-m", "benchmarks.lib.harness", str(spec_path), str(out)],
                           capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[1],
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"lm-eval run failed (exit {p.returncode}): {(p.stderr or p.stdout)[-3000:]}")
        return json.loads(out.read_text())


def client_spec(url: str, model_dir: Path, task_dir: Path, task: str, args, prefix: str) -> dict:
    """`--model local-completions` as an evaluator passes it: token-id prompts, the HF tokenizer."""
    return {"model": "local-completions", "batch_size": 1, "task": task, "include_path": str(task_dir),
            "metrics_url": url, "metrics_prefix": prefix,
            "model_args": {"model": MODEL, "base_url": url + "/v1/completions", "tokenizer": str(model_dir),
                           "tokenizer_backend": "huggingface", "tokenized_requests": True,
                           "num_concurrent": args.num_concurrent, "max_retries": 1, "max_length": args.max_model_len}}


def run_engine(engine: str, model_dir: Path, task_dir: Path, task: str, args, vllm_py: Path | None) -> dict:
    kv = args.kv_cache_memory
    if engine == "hf":
        spec = {"model": "hf", "batch_size": args.hf_batch_size, "task": task, "include_path": str(task_dir),
                "model_args": {"pretrained": str(model_dir), "dtype": "bfloat16"}}
        r = evaluate(spec, args.timeout)
        return {**r, "computed_tokens": r["forward_tokens"], "prefix_hit_rate": None, "prompt_logprob_hit_rate": None,
                "threads": r["client_threads"], "batch_size": args.hf_batch_size}
    if engine == "vllm":
        log = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        server = VllmServer(vllm_py, model_dir, free_port(), parse_bytes(kv), args.max_model_len, str(log))
        text, prefix = log.read_text, "vllm"
    else:
        flags = ["--dtype", "bfloat16", "--kv-cache-memory", kv, "--max-model-len", str(args.max_model_len)]
        server = ServeProcess(engine, flags + (["--no-enable-prefix-caching"] if engine == "pagedllm-no-prefix" else []))
        text, prefix = server.text, "pagedllm"
    try:
        r = evaluate(client_spec(server.url, model_dir, task_dir, task, args, prefix), args.timeout)
        log_text = text()
    finally:
        server.stop()
    c = r["server"]
    computed = c["computed"] if prefix == "pagedllm" else c["prompt"] - c["hits"]
    threads = threads_used(log_text) if prefix == "pagedllm" else re.findall(r"core ids=\[([0-9, ]*)\]", log_text)[:1]
    return {**r, "computed_tokens": computed, "prefix_hit_rate": c["hits"] / c["queries"] if c["queries"] else 0.0,
            "prompt_logprob_hit_rate": c["logprob_hits"] / c["logprob_queries"] if c["logprob_queries"] else None,
            "threads": threads, "batch_size": 1}


def agreement(rows: list[dict]) -> str | None:
    """Each run's argmax answers and loglikelihoods against the reference run's (hf's when it ran):
    the share of questions with the same answer, the largest |difference| of a loglikelihood."""
    ran = [r for r in rows if "loglikelihoods" in r]
    ref = next((r for r in ran if r["engine"] == "hf"), ran[0] if ran else None)
    if ref is None:
        return None
    pick = lambda lls: [max(range(len(q)), key=q.__getitem__) for q in lls]  # noqa: E731
    for r in ran:
        a, b = pick(r["loglikelihoods"]), pick(ref["loglikelihoods"])
        r["same_answer_as_reference"] = sum(x == y for x, y in zip(a, b)) / len(a)
        r["max_abs_loglikelihood_diff"] = max(abs(x - y) for p, q in zip(r["loglikelihoods"], ref["loglikelihoods"])
                                              for x, y in zip(p, q))
    return ref["engine"]


def report(rows: list[dict], reference: str | None) -> tuple[list[str], dict]:
    ran = [r for r in rows if "wall_s" in r]
    vllm = next((r for r in ran if r["engine"] == "vllm"), None)
    lines = [f"{'engine':<38} {'wall s':>8} {'acc':>6} {'acc_norm':>8} {'tokens sent':>12} {'computed':>10}"
             f" {'hit rate':>8} {'logprob hits':>12} {'same answer':>11} {'max |dLL|':>9}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['label']:<38} skipped: {r['skipped']}")
            continue
        hit = "-" if r["prefix_hit_rate"] is None else f"{100 * r['prefix_hit_rate']:.1f}%"
        lp_hit = "-" if r.get("prompt_logprob_hit_rate") is None else f"{100 * r['prompt_logprob_hit_rate']:.1f}%"
        lines.append(f"{r['label']:<38} {r['wall_s']:8.1f} {r['metrics']['acc']:6.3f} {r['metrics']['acc_norm']:8.3f}"
                     f" {r['prompt_tokens_sent']:12d} {r['computed_tokens']:10.0f} {hit:>8} {lp_hit:>12}"
                     f" {100 * r['same_answer_as_reference']:10.1f}% {r['max_abs_loglikelihood_diff']:9.4f}")
    ratios = {}
    if vllm is not None:
        for r in ran:
            ratios[r["engine"]] = {"wall_over_vllm": r["wall_s"] / vllm["wall_s"],
                                   "speedup_over_vllm": vllm["wall_s"] / r["wall_s"],
                                   "computed_tokens_over_vllm": r["computed_tokens"] / vllm["computed_tokens"]
                                   if vllm["computed_tokens"] else None}
        lines.append("against vllm serve, this run: " + "; ".join(
            f"{ENGINES[k]} {v['speedup_over_vllm']:.2f}x as fast, computes "
            + (f"{v['computed_tokens_over_vllm']:.2f}x the prompt tokens" if v["computed_tokens_over_vllm"] is not None
               else "(vLLM computed none)") for k, v in ratios.items() if k != "vllm"))
    if reference:
        lines.append(f"same answer, max |dLL|: against {ENGINES[reference]} (bf16 everywhere)")
    return lines, {"over_vllm": ratios, "reference": reference}


def where(p: dict) -> str:
    return (f"commit {p['commit'][:12]}{' (dirty)' if p['dirty'] else ''}, torch {p['torch']}, {p['threads']} "
            f"threads in the driver, {p['logical_cpus']} logical CPUs ({p['cpu']}), {p['date']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=240, help="questions (4 requests each)")
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="the generated questions' seed")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"any of {','.join(ENGINES)}, in this order")
    p.add_argument("--num-concurrent", type=int, default=8, help="lm-eval's requests in flight (batch size 1)")
    p.add_argument("--hf-batch-size", type=int, default=1, help="lm-eval hf's batch size")
    p.add_argument("--kv-cache-memory", default="2GiB", help="every server's KV budget")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm-venv", default=None, help="venv holding vllm-cpu (default ~/.cache/pagedllm/vllm-cpu-*)")
    p.add_argument("--setup-vllm", action="store_true", help="create the vLLM venv if it is missing (~1 GB)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds for one engine's evaluation")
    p.add_argument("--note", default="", help="recorded with the result (e.g. the machine's other load)")
    p.add_argument("--out", default="benchmarks/results/lm_eval_mc.json")
    args = p.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if unknown := [e for e in engines if e not in ENGINES]:
        p.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")

    model_dir = resolve_model_dir(None)
    vllm_py, why = vllm_python(Path(args.vllm_venv) if args.vllm_venv else None, create=args.setup_vllm) \
        if "vllm" in engines else (None, None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lm-eval-mc-") as d:
        task = write_mc_task(Path(d), args.limit, args.num_shots, args.seed)
        head = (f"workload: {args.limit} generated questions (seed {args.seed}), 4 lettered answers each behind one "
                f"{args.num_shots}-shot prefix: {4 * args.limit} loglikelihood requests, through lm-eval's "
                f"local-completions to the servers ({args.num_concurrent} in flight, batch size 1), lm-eval hf at batch "
                f"size {args.hf_batch_size}; bf16, KV {args.kv_cache_memory}, max_model_len {args.max_model_len}")
        print(head, flush=True)
        for engine in engines:
            load = os.getloadavg()[0]
            if engine == "vllm" and vllm_py is None:
                rows.append({"engine": engine, "label": ENGINES[engine], "skipped": why})
                print(f"{engine}: skipped: {why}", flush=True)
                continue
            r = run_engine(engine, model_dir, Path(d), task, args, vllm_py)
            rows.append({"engine": engine, "label": ENGINES[engine], "load_average_1min_before": load, **r})
            print(f"{engine}: {r['wall_s']:.1f} s, acc {r['metrics']['acc']:.3f}", flush=True)
    reference = agreement(rows)
    table, summary = report(rows, reference)
    print("\n".join(table))
    for r in rows:
        r.pop("loglikelihoods", None)  # summarised above; the result file stays small
    command = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    sent = next((r["prompt_tokens_sent"] for r in rows if "prompt_tokens_sent" in r), None)
    save_result({"benchmark": "lm_eval_mc", "command": command, "workload": f"mc {args.limit}x4, {args.num_shots}-shot",
                 "workload_options": {"questions": args.limit, "num_shots": args.num_shots, "seed": args.seed,
                                      "requests": 4 * args.limit, "prompt_tokens": sent},
                 "num_concurrent": args.num_concurrent, "kv_cache_memory": args.kv_cache_memory,
                 "max_model_len": args.max_model_len, "dtype": "bfloat16", "note": args.note, "results": rows,
                 **summary}, args.out)
    out_txt = Path(args.out).with_suffix(".txt")
    out_txt.write_text("\n".join([f"$ {command}", where(provenance()), args.note, head, *table]) + "\n")
    print(f"wrote {args.out} and {out_txt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
