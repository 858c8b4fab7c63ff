"""The same throughput benchmarks on an earlier commit and on this tree, in one command: did a
change (a refactor) cost offline or serving throughput?

The earlier commit is checked out with `git worktree` into a temporary folder; each engine runs
in its own process with its tree first on PYTHONPATH (the compiled kernels are shared when their
sources are the same), the two alternating for `--rounds` rounds, medians compared:

- offline: `pagedllm bench throughput`, ShareGPT prompts cut to --max-prompt-len, exactly
  --output-len new tokens each, greedy, one cold pass;
- A, B, 1.1b: the same offline run on BENCHMARKS' shapes: A (96 prompts <= 256, 128 out), B (64
  prompts <= 1,024, 256 out), 1.1b (TinyLlama 1.1B's shape, random weights written once under
  ~/.cache/pagedllm/shapes/, 32 prompts <= 256, 64 out);
- serve: `pagedllm serve` on 127.0.0.1 driven by this tree's `pagedllm bench serve` (the same
  client for both), every request sent at once.

    python -m benchmarks before_after --base c1fdda8 --out benchmarks/results/before_after.json
    python -m benchmarks before_after --base 6fbae06 --parts A,B,1.1b --rounds 2
    python -m benchmarks before_after --base 6d51174 --parts offline --model DIR --block-size 1024 \
        --num-prompts 32 --output-len 64 --dtype bfloat16 --rounds 2   # another model's directory
    python -m benchmarks before_after --base aa8dbb9 --parts offline --model gemma-3-270m --quantization gguf \
        --dtype float32 --num-prompts 16 --max-prompt-len 512 --output-len 32   # a GGUF's own blocks
    python -m benchmarks before_after --base b3183b5 --parts offline,B --kv-cache-dtype int8 --rounds 2   # a KV dtype
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedllm.bench.provenance import save_result
from pagedllm.util import free_port

ROOT = Path(__file__).resolve().parents[1]


# Offline cases on fixed shapes: (prompts, longest prompt, new tokens, random-weight shape or None: SmolLM2)
CASES = {"A": (96, 256, 128, None), "B": (64, 1024, 256, None), "1.1b": (32, 256, 64, "tinyllama-1.1b")}


def workload(a: argparse.Namespace) -> list[str]:
    return ["--workload", "sharegpt", "--num-prompts", str(a.num_prompts), "--max-prompt-len", str(a.max_prompt_len),
            "--truncate-prompts", "--sharegpt-output-len", str(a.output_len), "--seed", "0"]


def case_args(a: argparse.Namespace, part: str) -> argparse.Namespace:
    """The run's arguments for a part: a case's own workload (and model), or the flags' for offline/serve."""
    if part not in CASES:
        return a
    n, max_len, out_len, shape = CASES[part]
    model = None
    if shape is not None:
        from pagedllm.bench.shapes import make_model

        where = Path(f"~/.cache/pagedllm/shapes/{shape}").expanduser()
        model = str(where if (where / "config.json").exists() else make_model(shape, where))
    return argparse.Namespace(**{**vars(a), "num_prompts": n, "max_prompt_len": max_len, "output_len": out_len,
                                 "model": model})


def run_py(tree: Path, args: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "pagedllm", *args], cwd=tree, env=env, timeout=timeout,
                          capture_output=True, text=True, **kw)


def offline(tree: Path, a: argparse.Namespace, out: Path) -> dict:
    model = ["--model", a.model] if getattr(a, "model", None) else []
    model += ["--block-size", str(a.block_size)] if getattr(a, "block_size", None) else []
    model += ["--quantization", a.quantization] if getattr(a, "quantization", None) else []
    model += ["--kv-cache-dtype", a.kv_cache_dtype] if getattr(a, "kv_cache_dtype", None) else []
    r = run_py(tree, ["bench", "throughput", *workload(a), *model, "--dtype", a.dtype, "--warmup", "0",
                      "--out", str(out)], timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"offline run in {tree} failed:\n{r.stderr[-3000:]}")
    res = json.loads(out.read_text())
    res = res["results"][0] if "results" in res else res
    return {"output_tok_s": res["output_tok_s"], "elapsed_s": res["elapsed_s"], "runner": res.get("runner")}


def serve(tree: Path, a: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    log = open(out.with_suffix(".log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--dtype", a.dtype],
                            cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the server of {tree} did not start: {out.with_suffix('.log').read_text()[-3000:]}")
            time.sleep(0.5)
        r = run_py(ROOT, ["bench", "serve", *workload(a), "--base-url", f"http://127.0.0.1:{port}",
                          "--disable-tqdm", "--out", str(out)], timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"serve run against {tree} failed:\n{r.stderr[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    res = json.loads(out.read_text())
    return {k: res[k] for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "duration") if k in res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="offline: a model directory or GGUF (default: SmolLM2)")
    ap.add_argument("--block-size", type=int, default=None, help="offline: the engine's block size (a state model's)")
    ap.add_argument("--quantization", default=None, help="offline: gguf, int8, int4 or w8a8")
    ap.add_argument("--kv-cache-dtype", default=None, help="offline: how the KV cache stores K/V (int8, fp8, int4...)")
    ap.add_argument("--parts", default="offline,serve", help=f"of offline, serve, {', '.join(CASES)}")
    ap.add_argument("--out", default="benchmarks/results/before_after.json")
    a = ap.parse_args()
    base_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", a.base], capture_output=True, text=True,
                                 check=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="pagedllm-before-"))
    base = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), base_commit], check=True,
                   capture_output=True)
    trees = {"before": base, "after": ROOT}
    parts = [p for p in a.parts.split(",") if p]
    unknown = [p for p in parts if p not in ("offline", "serve", *CASES)]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from offline, serve, {', '.join(CASES)}")
    args = {p: case_args(a, p) for p in parts}
    rows: dict[str, dict[str, list[dict]]] = {p: {k: [] for k in trees} for p in parts}
    try:
        for i in range(a.rounds):
            for part in parts:
                for name, tree in trees.items():
                    run = serve if part == "serve" else offline
                    got = run(tree, args[part], tmp / f"{part}-{name}-{i}.json")
                    print(f"round {i + 1} {part} {name}: {got}", flush=True)
                    rows[part][name].append(got)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    key = {"serve": "output_throughput"}
    summary = {}
    for part in parts:
        med = {n: statistics.median(r[key.get(part, "output_tok_s")] for r in rows[part][n]) for n in trees}
        summary[part] = {"before_tok_s": med["before"], "after_tok_s": med["after"],
                         "after_over_before": med["after"] / med["before"], "workload": workload(args[part]),
                         "model": getattr(args[part], "model", None),
                         "block_size": getattr(args[part], "block_size", None),
                         "quantization": getattr(args[part], "quantization", None),
                         "kv_cache_dtype": getattr(args[part], "kv_cache_dtype", None)}
        print(f"{part}: before {med['before']:.1f} tok/s, after {med['after']:.1f} tok/s, "
              f"after/before {med['after'] / med['before']:.3f}")
    save_result({"benchmark": "before_after", "command": "python -m benchmarks before_after " + " ".join(sys.argv[1:]),
                 "base_commit": base_commit, "workload": workload(a), "dtype": a.dtype, "summary": summary,
                 "rounds": rows}, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
