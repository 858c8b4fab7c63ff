from __future__ import annotations

import gc
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

# torch-free: OMP_NUM_THREADS below is still set before torch is imported
from pagedllm.util import cache_root, cpu_flags


# Under pytest-xdist each worker runs on one thread: two workers then fill the two cores, with no
# matmul barrier waiting on a core that the other worker holds (the engine's governor reacts only
# after a second; the HF references and kernels called directly have no governor at all).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
# The suite's subprocesses (servers, ranks, replicas, about a hundred) each import the package. Where
# the environment asks for no bytecode (PYTHONDONTWRITEBYTECODE), each compiled it again from source
# (0.25 s of CPU a process, ~25 s a run): here it is written once, as Python does by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# No huge-page advice for the KV pools of the suite's engines, servers and their subprocesses:
# after a few dozen start-ups memory is fragmented, and the kernel's compaction for each new
# pool cost seconds of system time per engine (minutes over the suite). The advice itself is
# checked in tests/unit/test_kv_budget.py.
os.environ["PAGEDLLM_HUGE_PAGES"] = "0"
# Nor are the pools faulted in whole at start-up: an engine here writes a few blocks of a
# 256-512 MiB pool and is gone (tests/unit/test_kv_budget.py checks both ways).
os.environ["PAGEDLLM_KV_POPULATE"] = "0"


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_cpu(*flags): runs where /proc/cpuinfo lists one of these flags (a kernel "
                   "built for an instruction set this CPU lacks), skips elsewhere, in CI too")


def _missing_cpu(item) -> str | None:
    """The needs_cpu mark this CPU does not meet, in words; None where it has none or meets it."""
    mark = item.get_closest_marker("needs_cpu")
    if mark is None:
        return None
    flags = cpu_flags()
    if flags is not None and flags & set(mark.args):
        return None
    return f"this CPU has none of {', '.join(mark.args)} (/proc/cpuinfo)"


def pytest_runtest_setup(item):
    missing = _missing_cpu(item)
    if missing:
        pytest.skip(missing)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true (set by .ci/run) a skip is a failure: CI installs everything, so a test that skips there
    tests nothing. An expected failure (xfail) is not a skip and is left as it is. The one skip CI
    keeps is a needs_cpu test on a CPU that /proc/cpuinfo shows lacks the instructions: no install
    brings those. Where the CPU has them, a skip of the same test (a kernel that was not built) fails."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and _ci() and not _missing_cpu(item):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (skips are failures in CI): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips at import (pytest.skip(allow_module_level=True), importorskip) fails too."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"module skipped under CI=true (skips are failures in CI): {reason}"


ROOT = Path(__file__).resolve().parents[1]


# One id per test run, set by the process that loads this file first (pytest-xdist's controller,
# or a run without workers) and inherited by the workers it spawns: the background jobs' folders
# are named by it, so that every worker finds the one job of the run.
RUN_ID = os.environ.setdefault("PAGEDLLM_TEST_RUN", uuid.uuid4().hex[:12])
# The kernel chooser's verdicts (kernels/chooser.py) in a folder of the suite's own, cached whatever
# the load: the two workers keep each other busy, so none would be cached in the user's folder, and
# every process (workers, servers, their subprocesses) would time its own, a minute of the suite's
# time, and might run other paths than the test beside it. The first verdict stored for a shape
# stands for all of them, in this run and the next ones on this machine.
os.environ.setdefault("PAGEDLLM_KERNEL_CHOICE_DIR", str(cache_root() / "kernel_choice-tests"))
os.environ.setdefault("PAGEDLLM_KERNEL_CHOICE_BUSY_CPUS", "inf")


def _lowest_priority() -> None:
    """In the child of a background job: a process group of its own (so that stop() kills the
    compiler's children too) in the suite's session, at nice 19. Not a session of its own: under
    the kernel's autogroups (on by default) nice weighs only within a session, and a job in a
    session of its own took a full share against the whole suite: measured, two niced loops
    so placed cut two test workers' matmuls from 80 to 27 GFLOP/s each."""
    os.setpgid(0, 0)
    os.nice(19)


class BackgroundRun:
    """A long, self-contained job that some tests check (a compiler run), started as soon as the
    tests are collected, in a process at the lowest priority, so that it fills the CPU time the
    suite leaves idle (on 2 cores, much of a core while servers start and clients wait) instead
    of holding up the tests that need it. It runs once per run, whichever worker asks, in a
    folder named by the run: the worker that creates the folder starts the job, the others wait
    for its exit code to appear there (a second copy of a compile, as each worker once started,
    doubled its cost). The process that started the run cleans it up at the end."""

    def __init__(self, fixture: str, argv: list[str], env: dict[str, str], applies: bool = True) -> None:
        self.fixture, self.argv, self.env = fixture, argv, env  # "{dir}" in them: the job's folder
        self.applies = applies  # False where its tests skip (another CPU, triton not installed)
        self.dir = Path(tempfile.gettempdir()) / f"pagedllm-{fixture}-{RUN_ID}"

    def start(self) -> None:
        """Starts the job unless this run's job is started already (by this or another worker)."""
        try:
            self.dir.mkdir()
        except FileExistsError:
            return
        fill = lambda v: v.replace("{dir}", str(self.dir))  # noqa: E731
        # The exit code is written (atomically) when the job ends: the waiters poll for it.
        wrapper = ("import os, subprocess, sys\n"
                   "code = subprocess.call(sys.argv[2:])\n"
                   "open(sys.argv[1] + '.tmp', 'w').write(str(code))\n"
                   "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n")
        with open(self.dir / "output.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", wrapper, str(self.dir / "exit_code"),
                                     *(fill(a) for a in self.argv)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **{k: fill(v) for k, v in self.env.items()}},
                                    preexec_fn=_lowest_priority)
        (self.dir / "pid").write_text(str(proc.pid))

    def wait(self, timeout: float = 900) -> tuple[int, str, Path]:
        """(exit code, output, folder), started here if no worker started it."""
        self.start()
        done = self.dir / "exit_code"
        deadline = time.monotonic() + timeout
        while not done.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.fixture}: no exit code after {timeout} s ({self.dir})")
            time.sleep(0.5)
        return int(done.read_text()), (self.dir / "output.log").read_text(), self.dir

    def stop(self) -> None:
        """At the end of the run, in the process that started it (not in a worker, whose tests may
        end while another worker still waits for the job)."""
        if WORKER:
            return
        try:
            os.killpg(int((self.dir / "pid").read_text()), 9)
        except (OSError, ValueError):
            pass  # never started, or ended already
        shutil.rmtree(self.dir, ignore_errors=True)


def has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


# On a CPU without AVX-512 the native build of the kernels is the generic vector code already:
# the AVX2-only tests check it, and no second copy is compiled.
AVX2_SEPARATE = platform.machine() == "x86_64" and has_avx512()

# The AVX2-only copy's build: -march=x86-64-v3, head dim 64 only (the one its check runs; the
# attention kernel's instantiations per head dim are most of the compile: 2 CPU-minutes, not 5).
# Kept in the user's cache beside the native build, and keyed like it (sources, flags, torch, CPU):
# a run after the first loads it in a second instead of compiling for 1.5 CPU-minutes.
AVX2_ENV = {"PAGEDLLM_CPU_ARCH": "x86-64-v3", "PAGEDLLM_KERNEL_HEAD_DIMS": "64",
            "PAGEDLLM_CACHE": str(cache_root() / "avx2-copy")}

AVX2_KERNELS, TRITON_CHECK = BACKGROUND = [
    # The AVX2-only copy of the CPU kernels, in a cache of its own; the tests of CPUs without
    # AVX-512 load and check it in processes of their own.
    BackgroundRun("avx2_kernel_cache", [sys.executable, "-c", "from pagedllm.kernels import load_ops; load_ops()"],
                  AVX2_ENV, AVX2_SEPARATE),
    # The Triton kernels compiled for sm_80 and sm_90 by Triton's own compiler and ptxas.
    BackgroundRun("triton_compile_check", [sys.executable, str(ROOT / "scripts" / "triton_compile_check.py"),
                                           "--quick", "--json", "{dir}/kernels.json"], {},
                  importlib.util.find_spec("triton") is not None),
]


# Each test file's seconds in a recent run (setup, call and teardown; tests/file_costs.json, written
# by a run with PAGEDLLM_TEST_COSTS_OUT=tests/file_costs.json). Workers take whole files
# (--dist loadfile) in collection order: the longest first, so that no long file starts last
# while the other worker sits idle (longest-processing-time-first scheduling).
FILE_COSTS = ROOT / "tests" / "file_costs.json"
UNKNOWN_FILE_COST = 10.0   # a new file's guess, until the table is written again


def _by_cost_longest_first(items: list) -> None:
    import json

    costs = json.loads(FILE_COSTS.read_text()) if FILE_COSTS.exists() else {}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))

    def key(item) -> tuple[float, int]:
        f = item.nodeid.split("::")[0]
        return -costs.get(f, UNKNOWN_FILE_COST), first_seen[f]
    items.sort(key=key)   # stable: a file's tests keep their order


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if WORKER is None:   # the controller (or a run without workers) hears every phase of every test
        f = report.nodeid.split("::")[0]
        _file_seconds[f] = _file_seconds.get(f, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("PAGEDLLM_TEST_COSTS_OUT")
    if out and WORKER is None and _file_seconds:
        import json

        Path(out).write_text(json.dumps({f: round(s, 1) for f, s in sorted(_file_seconds.items())}, indent=0) + "\n")


def pytest_collection_modifyitems(session, config, items):
    _by_cost_longest_first(items)
    wanted = {f for item in items for f in getattr(item, "fixturenames", ())}
    for job in BACKGROUND:
        # every worker collects every test: gw0 starts the jobs (should a test ask first, its worker does)
        if job.applies and job.fixture in wanted and WORKER in (None, "gw0"):
            job.start()


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, the test modules: ~570k objects) lives as
    long as the run: moved out of the collector's sight (gc.freeze). Otherwise every full
    collection walks them, 0.35 s a time, and the suite makes hundreds: each engine that loads
    a model collects once (util.release_freed_heap), LLMCache before each runner, and CPython's
    own as the heap grows. Anything made later (engines, runners, their cycles) is collected
    as before."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    for job in BACKGROUND:
        job.stop()


@pytest.fixture(scope="session")
def avx2_kernel_cache() -> dict[str, str]:
    """The environment that loads the AVX2-only copy of the CPU kernels: on an AVX-512 CPU a copy
    built in a cache of its own (a failed build is not an error here: the test's own process
    then builds again and says why it cannot); on a CPU without AVX-512, the native build,
    which is that code already."""
    if not AVX2_SEPARATE:
        return {}
    AVX2_KERNELS.wait()
    return AVX2_ENV


@pytest.fixture(scope="session")
def triton_compile_check() -> tuple[int, str, Path]:
    """scripts/triton_compile_check.py --quick: (exit code, output, folder with kernels.json)."""
    return TRITON_CHECK.wait()


@pytest.fixture(scope="session")
def model_dir():
    from pagedllm.loader import resolve_model_dir

    return resolve_model_dir(None)  # the default SmolLM2 GGUF, converted once into the cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_dir) -> str:
    """The path of the tiny model (build_tiny_llama), built once per test run (per worker)."""
    from tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), model_dir))


@pytest.fixture(scope="session")
def tiny_flags(tiny_model) -> tuple[str, ...]:
    """`pagedllm serve`/`viz` flags for the tiny model: for server tests whose subject is the
    processes, pipes and HTTP, not the text."""
    from tiny import TINY_NAME

    return "--model", tiny_model, "--served-model-name", TINY_NAME


@pytest.fixture(scope="session")
def tiny_fp32(make_llm, tiny_model):
    """The tiny model's engine in float32: what llm_fp32 is for the real model."""
    return make_llm(model=tiny_model, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# What decides a model runner (weights, pool layout, kernels); the rest of EngineConfig is the
# engine's (scheduler, KV manager, pool size up to the runner's), so engines of other settings
# share one runner: one model load per runner configuration per test run.
RUNNER_FIELDS = ("model", "tokenizer", "dtype", "device", "attention_backend", "quantization", "batch_invariant",
                 "speculative_config", "kv_cache_dtype", "block_size", "num_threads", "enforce_eager", "allocation",
                 "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")
SHARED_POOL = "512MiB"   # the shared runners' pool: an engine uses what its config asks of it


class PoolView:
    """A runner seen with fewer blocks than it holds: the engine's KV manager hands out only
    block ids below `num_blocks` (the pool's other rows stay unused).

    Engines over one runner share its pool rows, so one engine's step overwrites what another's
    prefix cache points at. The view that steps the runner claims it: the engine that stepped
    it last drops its prefix cache (its blocks' KV is about to change) and the runner forgets
    its sequences; that engine must have no request in flight, or the test fails here."""

    def __init__(self, runner, num_blocks: int) -> None:
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "num_blocks", num_blocks)
        object.__setattr__(self, "engine", None)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value):
        if name == "engine":
            object.__setattr__(self, name, value)
        else:
            setattr(self._runner, name, value)

    def _claim(self) -> None:
        last = self._runner.__dict__.get("_test_view")
        if last is self:
            return
        if last is not None and last.engine is not None:
            if last.engine.has_unfinished_requests():
                raise RuntimeError("two engines interleave steps over one shared runner: give one of them "
                                   "a runner of its own (another runner setting, or a bigger pool)")
            last.engine.kv.reset_prefix_cache()
        self._runner.reset_sequences()
        self._runner.__dict__["_test_view"] = self

    def execute(self, plan):
        self._claim()
        return self._runner.execute(plan)

    def move_blocks(self, plan):
        self._claim()
        return self._runner.move_blocks(plan)


class LLMCache:
    """make_llm(**EngineConfig fields) -> LLM: a fresh engine (its own scheduler, KV manager,
    prefix cache and counters) over a model runner shared by every engine of the same runner
    configuration. Tensor parallelism, a KV tier and data parallelism get engines of their own."""

    # runners kept warm (a runner holds its weights and a 512 MiB pool: all of them do not fit; two
    # workers hold theirs side by side)
    KEEP = 2 if WORKER else 3

    def __init__(self) -> None:
        from collections import OrderedDict
        from weakref import WeakValueDictionary

        # Every live runner, found again while any engine (a fixture's) still holds it; the last
        # KEEP asked for are held here too, so a later test finds them warm.
        self.runners: WeakValueDictionary[tuple, object] = WeakValueDictionary()
        self.warm: OrderedDict[tuple, object] = OrderedDict()

    def __call__(self, model: str | None = None, **kw):
        from pagedllm import LLM
        from pagedllm.config import EngineConfig, parse_bytes
        from pagedllm.engine.engine import LLMEngine

        cfg = EngineConfig(model=model, **kw)   # a bad setting is refused here, before anything loads
        if cfg.tensor_parallel_size > 1 or cfg.kv_offload_dir is not None or cfg.data_parallel_size > 1:
            return LLM(model, **kw)
        key = tuple(repr(getattr(cfg, f)) for f in RUNNER_FIELDS)
        runner = self.runners.get(key)
        if runner is None:
            while len(self.warm) >= self.KEEP:   # the least recently asked for goes cold
                self.warm.popitem(last=False)
            gc.collect()   # engines and their views hold each other: free the cold runners' memory now
            base = EngineConfig(**{f: getattr(cfg, f) for f in ("model",) + RUNNER_FIELDS[1:]},
                                kv_cache_memory=SHARED_POOL)
            runner = self.runners[key] = LLMEngine(base).runner
        self.warm[key] = runner
        self.warm.move_to_end(key)
        per_block = runner.bytes_per_block + (runner.draft.bytes_per_token * cfg.block_size if runner.draft else 0)
        want = cfg.num_gpu_blocks_override or (parse_bytes(cfg.kv_cache_memory) // per_block if cfg.kv_cache_memory
                                               else runner.num_blocks)
        if want > runner.num_blocks:   # more than the shared pool: a runner of its own
            return LLM(model, **kw)
        view = PoolView(runner, want)
        view.engine = LLMEngine(cfg, runner=view)
        return LLM.from_engine(view.engine)


@pytest.fixture(scope="session")
def make_llm() -> LLMCache:
    return LLMCache()


@pytest.fixture(scope="session")
def llm_fp32(make_llm):
    return make_llm(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)


@pytest.fixture(scope="session")
def llm_fast(make_llm):
    """llm_fp32's engine in the dtype the CPU runs fast (hw.FAST_DTYPE): for what is held to
    itself or to an engine of the same dtype, not to HF transformers' float32."""
    from hw import FAST_DTYPE

    return make_llm(dtype=FAST_DTYPE, kv_cache_memory="256MiB", max_model_len=2048)


@pytest.fixture(params=["torch", "cpu"])
def window_backend(request) -> str:
    """The attention backends that take a sliding window: the torch reference and the
    compiled CPU kernel."""
    return request.param
