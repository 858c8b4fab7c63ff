"""The engine layer before and after (issue 24), side by side in one command: two trees of
this repository, each measured in fresh processes with its own `pagedllm` first on PYTHONPATH.

    python -m benchmarks engine_layer --before 530b530 --rates 2,4 --num-prompts 200 --rounds 2
    python -m benchmarks engine_layer --quick --after 7bdaeda     # a smoke run, ~2 minutes

On 2 quiet cores the first takes about 25 minutes (serving ~5 minutes a server, 4 servers).

--before and --after are git revisions (materialised with `git archive` into a temporary
directory) or `worktree`, the checkout this script is run from (--after's default; a dirty
one is recorded as such). Each tree first builds an engine and runs a few requests (CPU
kernels built, model converted, files cached), untimed. Then, in rounds of before, after:

(a) Decode steps at batch --batch (96): that many ShareGPT prompts (cut to --step-prompt-len,
    not dropped) decode together, greedy, EOS ignored. Only steps whose plan is --batch
    sequences of one token each are timed; engine.step() in blocks that alternate between
    the offline setting and stream_outputs=True (the server's: every running request's
    output built every step), with runner.execute wrapped in a timer, so the time a step
    spends outside the runner is measured too; then engine.stats() alone.
(b) Serving: `python -m pagedllm serve` with the same flags for both trees, driven by
    pagedllm.bench.serve_client (this checkout's, for both) at each --rates (Poisson, seeded):
    ShareGPT first turns cut to --max-prompt-len, replies capped at --max-output-len, EOS
    ignored; each rate gets its own prompts (no prefix hits carried from the last rate) and
    the server first serves a few others, untimed. TTFT and TPOT as vLLM defines them.

Threads are fixed (--num-threads; the governor off, PAGEDLLM_ADAPT_THREADS=0) unless
--adapt-threads. Every figure records how many CPUs other processes used meanwhile.
Prints after/before ratios (the mean of the rounds, then each round's); writes
benchmarks/results/engine_layer.json and .txt (engine_layer_smoke.* for --quick).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CHILDREN: set[subprocess.Popen] = set()


# -- in the tree under test (a fresh process; only its own pagedllm imported) --------------
def _plan_shape(plan) -> tuple[int, int] | None:
    """(sequences, tokens) of a step's plan, where the tree's plan has chunks."""
    try:
        return len(plan.chunks), sum(len(c.token_ids) for c in plan.chunks)
    except (AttributeError, TypeError):
        return None


class _TimedRunner:
    """Wraps runner.execute: the time and plan shape of each call."""

    def __init__(self, runner) -> None:
        self.seconds: list[float] = []
        self.shape: tuple[int, int] | None = None
        self.inner = runner.execute
        runner.execute = self

    def __call__(self, plan, *args, **kwargs):
        self.shape = _plan_shape(plan)
        t0 = time.perf_counter()
        try:
            return self.inner(plan, *args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - t0)


def _engine(spec: dict):
    import pagedllm
    import torch
    from pagedllm import LLM

    engine = LLM(**spec["engine"]).engine
    runner = getattr(engine, "runner", None)
    describe = getattr(runner, "describe", None)
    info = {"pagedllm": pagedllm.__file__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "runner": describe() if describe else None}
    return engine, info


def _add(engine, prompts: list[list[int]], max_tokens: int, max_model_len: int) -> None:
    from pagedllm import SamplingParams

    for i, ids in enumerate(prompts):
        n = min(max_tokens, max_model_len - len(ids))
        engine.add_request(str(i), ids, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))


def worker_warm(spec: dict) -> dict:
    t0 = time.perf_counter()
    engine, info = _engine(spec)
    _add(engine, spec["prompts"], 8, spec["engine"]["max_model_len"])
    while engine.has_unfinished_requests():
        engine.step()
    return {**info, "warm_s": time.perf_counter() - t0}


def worker_step(spec: dict) -> dict:
    engine, info = _engine(spec)
    batch, warm, steps = len(spec["prompts"]), spec["warm_steps"], spec["steps"]
    timer = _TimedRunner(engine.runner) if hasattr(getattr(engine, "runner", None), "execute") else None
    # As many tokens as max_model_len allows: none finishes while we time (prefill may take long).
    _add(engine, spec["prompts"], 1 << 30, spec["engine"]["max_model_len"])
    full = (batch, batch)
    # Prefill (chunked, mixed with the first decodes) until `warm` plain decodes at full batch.
    # A plan we cannot read: enough steps for every prompt token, then `warm` more.
    budget = math.ceil(sum(map(len, spec["prompts"])) / max(1, spec["max_batched"] - batch)) + 2
    run, prefill_steps = 0, 0
    while run < warm:
        engine.step()
        prefill_steps += 1
        shape = timer.shape if timer else None
        if prefill_steps > 4 * budget + 100:
            raise RuntimeError(f"no step ran {batch} decodes after {prefill_steps} steps (last plan: {shape})")
        run = run + 1 if (shape == full or (shape is None and prefill_steps > budget)) else 0
    modes = {"step": False}
    if hasattr(engine, "stream_outputs"):
        modes["step_stream"] = True
    times = {m: [] for m in modes}
    outside = {m: [] for m in modes}
    skipped, block = 0, min(8, steps)
    for b in range(math.ceil(steps / block)):
        for mode in (list(modes)[b % len(modes):] + list(modes)[:b % len(modes)]):  # rotate the order
            if "step_stream" in modes:
                engine.stream_outputs = modes[mode]
            for _ in range(block):
                n = len(timer.seconds) if timer else 0
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
                if timer and timer.shape not in (full, None):
                    skipped += 1
                    continue
                times[mode].append(dt)
                if timer and len(timer.seconds) == n + 1:
                    outside[mode].append(dt - timer.seconds[-1])
    stats_s = []
    if hasattr(engine, "stats"):
        for _ in range(10):
            t0 = time.perf_counter()
            engine.stats()
            stats_s.append(time.perf_counter() - t0)
    out = {**info, "batch": batch, "prefill_steps": prefill_steps, "skipped_steps": skipped,
           "plan_read": bool(timer and timer.shape is not None)}
    for mode in modes:
        out[mode] = {"n": len(times[mode]), **_ms(times[mode]), "outside_execute": _ms(outside[mode])}
    out["stats"] = _ms(stats_s)
    return out


def _ms(xs: list[float]) -> dict:
    if not xs:
        return {"mean_ms": None, "median_ms": None}
    return {"mean_ms": 1e3 * statistics.fmean(xs), "median_ms": 1e3 * statistics.median(xs)}


def worker_main(kind: str, spec_path: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    result = {"warm": worker_warm, "step": worker_step}[kind](spec)
    Path(spec["out"]).write_text(json.dumps(result))


# -- the driver (this checkout) -------------------------------------------------------------
@dataclass
class Tree:
    side: str          # before / after
    rev: str           # as given
    commit: str
    path: Path
    dirty: bool = False

    def env(self, adapt_threads: bool) -> dict:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.path), os.environ.get("PYTHONPATH", "")])}
        env["PAGEDLLM_ADAPT_THREADS"] = "1" if adapt_threads else "0"
        return env


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def materialise(side: str, rev: str, tmp: Path) -> Tree:
    if rev == "worktree":
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        return Tree(side, rev, _git("rev-parse", "HEAD"), ROOT, dirty)
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = tmp / side
    path.mkdir()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(path)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return Tree(side, rev, commit, path)


def _start(cmd: list[str], tree: Tree, args, log: Path) -> subprocess.Popen:
    """A child in its own process group (killed whole on any exit), in the tree's root."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tree.path, env=tree.env(args.adapt_threads), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    _CHILDREN.add(proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """The child's whole process group: SIGTERM (a server drains), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    _CHILDREN.discard(proc)


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def check_import(tree: Tree, args) -> str:
    """Where `import pagedllm` resolves in the tree's processes; it must be the tree itself."""
    run = subprocess.run([sys.executable, "-c", "import pagedllm; print(pagedllm.__file__)"], cwd=tree.path,
                         env=tree.env(args.adapt_threads), capture_output=True, text=True, timeout=120)
    where = run.stdout.strip()
    if run.returncode != 0 or not Path(where).resolve().is_relative_to(tree.path.resolve()):
        raise RuntimeError(f"pagedllm for the {tree.side} tree resolves to {where or run.stderr[-500:]!r}, "
                           f"not under {tree.path}")
    return where


class CpuMeter:
    """CPUs that other processes kept busy between start and stop: /proc/stat's busy time
    less this driver's and its measured children's."""

    def __init__(self, child_pid: int | None = None) -> None:
        self.pid = child_pid
        self.t0, self.busy0, self.ours0 = time.monotonic(), _busy(), self._ours()

    def _ours(self) -> float:
        own = time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime \
            + resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime
        if self.pid is not None:
            try:
                fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
                own += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
        return own

    def stop(self) -> float | None:
        busy = _busy()
        if busy is None or self.busy0 is None:
            return None
        wall = time.monotonic() - self.t0
        return max(0.0, (busy - self.busy0) - (self._ours() - self.ours0)) / wall


def _busy() -> float | None:
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, parts[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_worker(kind: str, tree: Tree, spec: dict, args, tmp: Path, tag: str) -> dict:
    out, spec_path, log = tmp / f"{tag}.out.json", tmp / f"{tag}.spec.json", tmp / f"{tag}.log"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    meter = CpuMeter()
    proc = _start([sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(spec_path)], tree, args, log)
    try:
        proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{kind} run of the {tree.side} tree over {args.timeout} s; log:\n{_tail(log)}") from None
    finally:
        _stop(proc)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{kind} run of the {tree.side} tree exited {proc.returncode}:\n{_tail(log)}")
    result = json.loads(out.read_text())
    if not Path(result["pagedllm"]).resolve().is_relative_to(tree.path.resolve()):
        raise RuntimeError(f"the {tree.side} tree's {kind} run imported {result['pagedllm']}")
    return {**result, "others_cpus": meter.stop()}


def serve(tree: Tree, rate_reqs: dict[float, list], warm_reqs: list, args, tmp: Path, tag: str) -> dict:
    import httpx
    from pagedllm.bench.serve_client import run_serve_bench
    from benchmarks.lib.vllm_baseline import wait_healthy
    from pagedllm.util import free_port

    port, log = free_port(), tmp / f"{tag}.server.log"
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), *server_flags(args)]
    proc = _start(cmd, tree, args, log)
    url, rows = f"http://127.0.0.1:{port}", {}
    try:
        try:
            wait_healthy(url, proc, timeout=args.timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; log:\n{_tail(log)}") from None
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        run_serve_bench(url, model, warm_reqs, float("inf"), None, args.seed)
        for rate, reqs in rate_reqs.items():
            meter = CpuMeter(proc.pid)
            r = run_serve_bench(url, model, reqs, rate, None, args.seed)
            kept = {k: v for k, v in r.items() if not isinstance(v, list)}
            rows[f"{rate:g}"] = {**kept, "errors": r["errors"][:5], "others_cpus": meter.stop()}
            if r["failed"]:
                print(f"  {tree.side}: {r['failed']} of {r['num_prompts']} requests failed: {r['errors'][:2]}",
                      flush=True)
    finally:
        _stop(proc)
    return rows


def server_flags(args) -> list[str]:
    return ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--num-threads", str(args.num_threads),
            "--kv-cache-memory", args.kv_cache_memory, *shlex.split(args.serve_args)]


def engine_kwargs(args) -> dict:
    return {"dtype": args.dtype, "max_model_len": args.max_model_len, "num_threads": args.num_threads,
            "kv_cache_memory": args.kv_cache_memory, "model": args.model}


def workloads(args) -> tuple[list[list[int]], dict[float, list], list]:
    """Token ids, the same for both trees: the step batch, each rate's requests, the warm-up's."""
    from pagedllm.bench.sharegpt import BenchRequest
    from pagedllm.bench.workloads import WorkloadOptions, load_workload
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(args.model))
    step = load_workload("sharegpt", tok, WorkloadOptions(num_prompts=args.batch, seed=args.seed,
                                                           max_prompt_len=args.step_prompt_len, truncate=True))
    n_warm = 4 if args.quick else 8
    reqs = load_workload("sharegpt", tok, WorkloadOptions(
        num_prompts=args.num_prompts * len(args.rate_list) + n_warm, seed=args.seed + 1,
        max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len, truncate=True))
    if len(reqs) < args.num_prompts * len(args.rate_list) + n_warm:
        raise SystemExit(f"ShareGPT gave only {len(reqs)} requests")
    per_rate = {rate: reqs[i * args.num_prompts:(i + 1) * args.num_prompts] for i, rate in enumerate(args.rate_list)}
    warm = [BenchRequest(r.prompt, r.prompt_len, min(r.output_len, 16)) for r in reqs[-n_warm:]]
    return [list(r.prompt) for r in step], per_rate, warm


# -- the report -------------------------------------------------------------------------------
STEP_ROWS = [("step", "mean_ms", "engine.step(), mean ms"), ("step", "median_ms", "engine.step(), median ms"),
             ("step", "outside_execute.mean_ms", "  outside runner.execute, mean ms"),
             ("step_stream", "mean_ms", "step with stream_outputs, mean ms"),
             ("step_stream", "median_ms", "step with stream_outputs, median ms"),
             ("step_stream", "outside_execute.mean_ms", "  outside runner.execute, mean ms"),
             ("stats", "median_ms", "engine.stats() alone, median ms")]
SERVE_ROWS = [("output_throughput", "output tok/s")] + [
    (f"{s}_{k}_ms", f"{k.upper()} {s}, ms") for k in ("ttft", "tpot") for s in ("mean", "median", "p99")]


def _get(d: dict | None, path: str):
    for key in path.split("."):
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.fmean(xs) if xs else None


def _fmt(x: float | None) -> str:
    return f"{x:10.2f}" if x is not None else f"{'n/a':>10}"


def _row(label: str, before: list, after: list) -> str:
    """Means over the rounds, their ratio, and each round's own ratio."""
    b, a = _mean(before), _mean(after)
    per_round = [f"{y / x:.3f}" for x, y in zip(before, after) if isinstance(x, (int, float))
                 and isinstance(y, (int, float)) and x]
    ratio = f"{a / b:8.3f}" if a is not None and b else f"{'n/a':>8}"
    return f"  {label:<38}{_fmt(b)}{_fmt(a)}{ratio}   {', '.join(per_round)}"


NOISY_CPUS = 0.25  # other processes' CPU use beyond which a figure is flagged


def _others(side: dict) -> list[float]:
    """Other processes' CPU use during each of one side's measurements in a round."""
    runs = [side.get("step_result") or {}, *(side.get("serve") or {}).values()]
    return [r["others_cpus"] for r in runs if isinstance(r.get("others_cpus"), (int, float))]


def report(doc: dict) -> str:
    rounds, trees = doc["rounds"], doc["trees"]

    def side(s: str, key: str) -> list[dict | None]:  # one side's result of each round
        return [r[s].get(key) for r in rounds]

    head = f"  {'':<38}{'before':>10}{'after':>10}{'a/b':>8}   per round a/b"
    lines = [f"engine layer, before {trees['before']['rev']} ({trees['before']['commit'][:9]}) vs after "
             f"{trees['after']['rev']} ({trees['after']['commit'][:9]}{', dirty' if trees['after']['dirty'] else ''})",
             f"{doc['provenance']['cpu']}, torch {doc['provenance']['torch']}, {doc['args']['num_threads']} threads"
             f" (governor {'on' if doc['args']['adapt_threads'] else 'off'}), {doc['args']['dtype']}, "
             f"{len(rounds)} round(s) of before then after; a/b < 1 is faster for times",
             f"command: {doc['command']}"]
    if doc["smoke"]:
        lines.insert(0, "SMOKE RUN (--quick): checks that the script works; its figures measure nothing.")
    if doc.get("aborted"):
        lines.insert(0, f"RUN ABORTED ({doc['aborted']}): what follows is what was measured before.")
    steps = side("before", "step_result"), side("after", "step_result")
    lines += ["", f"(a) decode steps at batch {doc['args']['batch']} (ShareGPT prompts cut to "
                  f"{doc['args']['step_prompt_len']} tokens)", head]
    for mode, key, label in STEP_ROWS:
        lines.append(_row(label, [_get(x, f"{mode}.{key}") for x in steps[0]],
                          [_get(x, f"{mode}.{key}") for x in steps[1]]))
    for s, results in zip(("before", "after"), steps):
        busy = [f"{x:.2f}" for x in (_get(r, "others_cpus") for r in results) if x is not None]
        if busy:
            lines.append(f"  {s}: {_get(results[0], 'runner')}; other processes used {', '.join(busy)} CPUs")
    lines += ["", f"(b) serving, ShareGPT, {doc['args']['num_prompts']} requests per rate (prompts cut to "
                  f"{doc['args']['max_prompt_len']}, outputs <= {doc['args']['max_output_len']}), seed "
                  f"{doc['args']['seed']}; flags: {' '.join(doc['server_flags'])}"]
    serves = side("before", "serve"), side("after", "serve")
    for rate in doc["args"]["rate_list"]:
        at = [[(x or {}).get(f"{rate:g}") for x in xs] for xs in serves]
        sizes = next((f": {r['completed']} requests, {r['total_input_tokens']} prompt and "
                      f"{r['total_output_tokens']} output tokens" for r in at[0] + at[1] if r), "")
        lines += [f" {rate:g} req/s{sizes}", head]
        for key, label in SERVE_ROWS:
            lines.append(_row(label, [_get(x, key) for x in at[0]], [_get(x, key) for x in at[1]]))
        busy = [f"{x:.2f}" for x in (_get(r, "others_cpus") for r in at[0] + at[1]) if x is not None]
        if busy:
            lines.append(f"  other processes used {', '.join(busy)} CPUs (before runs, then after)")
    noisy = [x for r in rounds for side_ in r.values() for x in _others(side_) if x > NOISY_CPUS]
    if noisy:
        lines.append(f"WARNING: other processes kept up to {max(noisy):.2f} CPUs busy during some figures; "
                     "with fixed threads those figures are not comparable (rerun on a quiet machine)")
    for s in ("before", "after"):
        warm = trees[s].get("warm") or {}
        lines.append(f"warm-up, {s}: {warm['warm_s']:.1f} s (untimed; a kernel build or model conversion lands here)"
                     if warm else f"warm-up, {s} FAILED: {trees[s].get('import_error') or trees[s].get('warm_error')}")
    for r_i, r in enumerate(rounds):
        for s in ("before", "after"):
            for key, err in r[s].items():
                if key.endswith("_error"):
                    lines.append(f"round {r_i + 1} {s} {key[:-6]} FAILED: {err}")
    return "\n".join(lines) + "\n"


def _guarded(rec: dict, key: str, fn) -> None:
    """One measurement of one tree: its error is recorded and reported, the run goes on."""
    try:
        rec[key] = fn()
    except Exception as e:  # noqa: BLE001 - any failure of the tree under test is a result
        rec[f"{key}_error"] = f"{type(e).__name__}: {e}"
        print(f"  FAILED: {rec[f'{key}_error']}", flush=True)


def measure(args, doc: dict, trees: dict[str, Tree], tmp: Path, save) -> None:
    step_prompts, rate_reqs, warm_reqs = workloads(args)
    eng = engine_kwargs(args)
    step_spec = {"engine": eng, "prompts": step_prompts, "warm_steps": 2 if args.quick else 5,
                 "steps": args.steps, "max_batched": 2048}  # EngineConfig's max_num_batched_tokens, not changed
    for s, tree in trees.items():
        print(f"{s}: {tree.rev} at {tree.path}, warming up", flush=True)
        warm = doc["trees"][s]
        _guarded(warm, "import", lambda: check_import(tree, args))
        _guarded(warm, "warm", lambda: run_worker("warm", tree, {"engine": eng, "prompts": step_prompts[:4]},
                                                   args, tmp, f"{s}-warm"))
        save()
    ready = {s: t for s, t in trees.items() if not any(k.endswith("_error") for k in doc["trees"][s])}
    for i in range(args.rounds):
        rec = {"before": {}, "after": {}}
        doc["rounds"].append(rec)
        for s, tree in ready.items():
            print(f"round {i + 1}: {s} decode steps at batch {args.batch}", flush=True)
            _guarded(rec[s], "step_result", lambda: run_worker("step", tree, step_spec, args, tmp, f"{s}-step{i}"))
            save()
        for s, tree in ready.items():
            print(f"round {i + 1}: {s} serving at {args.rates} req/s", flush=True)
            _guarded(rec[s], "serve", lambda: serve(tree, rate_reqs, warm_reqs, args, tmp, f"{s}-serve{i}"))
            save()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="530b530", help="git revision, or 'worktree'")
    ap.add_argument("--after", default="worktree", help="git revision, or 'worktree' (this checkout)")
    ap.add_argument("--rates", default="2,4", help="request rates, req/s")
    ap.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    ap.add_argument("--max-prompt-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of before, after")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--step-prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per setting")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--num-threads", type=int, default=None, help="default: one per physical core")
    ap.add_argument("--adapt-threads", action="store_true", help="leave the thread governor on")
    ap.add_argument("--serve-args", default="", help="more `pagedllm serve` flags, for both trees")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for a server to start or a run to end")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 12 short requests a rate, 8 steps, "
                    "512MiB of KV (a flag given wins)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary trees and logs")
    ap.add_argument("--out", default=None, help="JSON path (.txt beside it)")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in {"num_prompts": 12, "max_prompt_len": 256, "max_output_len": 32, "rounds": 1,
                           "step_prompt_len": 64, "steps": 8, "kv_cache_memory": "512MiB"}.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    if args.num_threads is None:
        from pagedllm.runtime.threads import physical_cores
        args.num_threads = physical_cores()
    args.rate_list = [float(x) for x in args.rates.split(",")]
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"engine_layer{'_smoke' if args.quick else ''}.json")
    return args


def main() -> int:
    sys.path.insert(0, str(ROOT))  # this checkout's bench tools, whatever the venv's editable install points at
    args = parse_args()
    from pagedllm.bench.provenance import provenance, save_result

    for sig in (signal.SIGTERM, signal.SIGHUP):  # finally blocks run, children die
        signal.signal(sig, lambda n, _f: sys.exit(128 + n))
    tmp = Path(tempfile.mkdtemp(prefix="engine_layer_"))
    doc = {"command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(), "smoke": args.quick,
           "nice": os.getpriority(os.PRIO_PROCESS, 0), "loadavg_at_start": os.getloadavg(),
           "args": vars(args), "server_flags": server_flags(args), "provenance": provenance(), "trees": {},
           "rounds": []}

    def save() -> None:
        save_result(doc, args.out)

    t0 = time.monotonic()
    try:
        trees = {s: materialise(s, rev, tmp) for s, rev in (("before", args.before), ("after", args.after))}
        doc["trees"] = {s: {"rev": t.rev, "commit": t.commit, "dirty": t.dirty, "path": str(t.path)}
                        for s, t in trees.items()}
        measure(args, doc, trees, tmp, save)
    except BaseException as e:  # interrupted, or a usage error: say so in what was written
        doc["aborted"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        for proc in list(_CHILDREN):
            _stop(proc)
        doc["elapsed_s"] = time.monotonic() - t0
        if doc["trees"]:
            save()
            text = report(doc)
            Path(args.out).with_suffix(".txt").write_text(text)
            print("\n" + text + f"wrote {args.out} and its .txt ({doc['elapsed_s']:.0f} s)")
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    failed = any(k.endswith("_error") for r in doc["rounds"] for s in r.values() for k in s) or any(
        k.endswith("_error") for t in doc["trees"].values() for k in t)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
