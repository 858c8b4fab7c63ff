"""Which kernel computes a product, decided on this machine by timing the candidates.

Several paths compute the same matmul: our bf16 panels (csrc/bf16_panels.h), oneDNN on a
weight reordered once (AMX where the CPU has it), for W8A8 oneDNN's int8 on a reordered weight
or torch._int_mm on the plain one. Which is fastest depends on the CPU, not on the build flags:
on a 2-core AMD Zen 4 (AVX-512 BF16, no AMX) the panels ran 1.1-1.6x oneDNN over SmolLM2's
step, while on an Intel Xeon with AMX oneDNN ran 3.5-5.4x the panels (issue 58). So at first
load each op shape's candidates are timed at the row counts a step runs (one sequence, a few,
a decode batch, a prefill chunk), the fastest taken per row range, and the verdict cached per
machine (CPU model and flags, torch, the kernels' build flags, threads) under
~/.cache/pagedllm/kernel_choice/, so later starts only read it. A verdict is keyed by the
sources of the kernel it times too (its csrc/ file and the headers that includes): an edit of
the panels' kernel times the linear layers again, not the experts or the attention.

Timed as a step runs them: a step streams every weight from memory, so a small weight timed
alone would sit in the caches and flatter whichever path reads it more often. Each candidate
runs over enough copies of the weight to fill twice the last-level cache at the row counts
where memory is the limit, and the candidates alternate, so a slow second on the machine
falls on all of them. A verdict measured while other processes used our CPUs is kept for this
process only, never cached: it would speak for a busy machine on every later start.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..util import allowed_cpus, busy_cpu_seconds, cache_root, cpu_flags

logger = logging.getLogger(__name__)

VERSION = 1   # of the timing method: a change here retires every cached verdict
ROWS = (1, 4, 16, 32, 96, 256, 512)   # one sequence, a few, decode batches, a prefill chunk
COLD_ROWS = 32     # up to here a product is limited by its weight's bytes: time it from memory
REPS = 3
HOPELESS = 8
# A call this long is timed in one pass after its first: the passes' spread is a few ms, small
# beside it, and two more passes of a big layer at 512 rows cost seconds (Gemma 3's 262144 x 640
# LM head took 116 s to choose on a 2-core AVX2 EPYC with three).
LONG_CALL = 0.25
# A second layout of a weight costs its memory again: kept only where the path it serves
# wins by more than this at some row count; otherwise the one path closest to the best
# everywhere runs every row count.
SECOND_LAYOUT_GAIN = 1.05
BUSY_CPUS = 0.25   # other processes' CPUs during a measurement past which it is not cached
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
            "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


@dataclass(frozen=True)
class Candidate:
    """One way to compute an op: `layout` turns a weight (as the op's caller holds it) into
    what `run` reads; run(layout, x) computes the product of rows x with it."""
    name: str
    layout: Callable[[Any], Any]
    run: Callable[[Any, torch.Tensor], Any]


@dataclass(frozen=True)
class Route:
    """Row count -> path: paths[i] takes m <= bounds[i]; the last path every count above."""
    paths: tuple[str, ...]
    bounds: tuple[int, ...] = ()

    def pick(self, m: int) -> str:
        return self.paths[bisect_left(self.bounds, m)] if self.bounds else self.paths[0]

    def describe(self) -> str:
        if not self.bounds:
            return self.paths[0]
        parts, lo = [], 1
        for path, hi in zip(self.paths, (*self.bounds, None)):
            parts.append(f"{path} {lo}-{hi}" if hi is not None else f"{path} {lo}+")
            lo = (hi or 0) + 1
        return ", ".join(parts)


@dataclass
class Verdict:
    """An op shape's candidates timed on this machine (seconds a call at each of `rows`) and
    the route taken from them. source: measured, cache, forced, only (one candidate), or
    measured-busy (not cached)."""
    op: str
    shape: tuple[int, ...]
    flops_per_row: int
    rows: tuple[int, ...]
    seconds: dict[str, list[float]]
    route: Route
    source: str = "measured"
    measure_s: float = 0.0
    power: int = 1   # the work grows as rows ** power (2: attention, each row over every row before it)

    def gflops(self, name: str) -> list[float]:
        return [self.flops_per_row * m ** self.power / s / 1e9 for m, s in zip(self.rows, self.seconds[name])]

    def to_json(self) -> dict:
        return {"op": self.op, "shape": list(self.shape), "flops_per_row": self.flops_per_row,
                "rows": list(self.rows), "seconds": self.seconds, "paths": list(self.route.paths),
                "bounds": list(self.route.bounds), "measure_s": round(self.measure_s, 3), "power": self.power}

    @classmethod
    def from_json(cls, d: dict) -> Verdict:
        return cls(d["op"], tuple(d["shape"]), d["flops_per_row"], tuple(d["rows"]), d["seconds"],
                   Route(tuple(d["paths"]), tuple(d["bounds"])), "cache", d.get("measure_s", 0.0), d.get("power", 1))


def route_of(rows: tuple[int, ...], seconds: dict[str, list[float]], gain: float = SECOND_LAYOUT_GAIN) -> Route:
    """The fastest candidate at the fewest rows, then a switch (at the geometric middle between
    two measured counts) wherever the path running is slower than the best by more than `gain`:
    ties and noise do not flip it. One path wherever one stays within `gain` of the best at
    every count (the one losing least over all)."""
    names = list(seconds)
    fastest = [min(names, key=lambda c: seconds[c][i]) for i in range(len(rows))]
    loss = {c: [seconds[c][i] / seconds[fastest[i]][i] for i in range(len(rows))] for c in names}
    singles = [c for c in names if max(loss[c]) <= gain]
    if singles:
        return Route((min(singles, key=lambda c: sum(loss[c])),))
    paths, bounds = [fastest[0]], []
    for i in range(1, len(rows)):
        if loss[paths[-1]][i] > gain:
            bounds.append(math.isqrt(rows[i - 1] * rows[i]))
            paths.append(fastest[i])
    return Route(tuple(paths), tuple(bounds))


def cold_bytes() -> int:
    """Twice the last-level cache (64 MiB where it cannot be read): what a weight's copies fill
    so that each call reads its weight from memory, as in a step."""
    for index in ("index3", "index2"):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/{index}/size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        return min(256 << 20, 2 * int(text.rstrip("KMG")) * scale)
    return 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: how op names spell a dtype."""
    return str(dtype).removeprefix("torch.")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """The flags of FEATURES this CPU has (what the kernels and oneDNN dispatch on)."""
    flags = cpu_flags() or set()
    return [f for f in FEATURES if f in flags]


def machine(kernels_build: str | None) -> dict:
    """What a verdict holds for: the CPU, torch, our kernels' build and the thread count."""
    return {"cpu": cpu_name(), "features": cpu_features(), "torch": torch.__version__,
            "kernels": kernels_build, "threads": torch.get_num_threads(), "version": VERSION}


def time_candidates(candidates: list[Candidate], make_weight: Callable[[torch.Generator], Any], weight_bytes: int,
                    make_input: Callable[[int], torch.Tensor], rows: tuple[int, ...]) -> dict[str, list[float]]:
    """Seconds a call of each candidate at each row count (median of REPS passes over the
    weight's copies, the candidates alternating; one pass for a call over LONG_CALL)."""
    copies = max(1, min(64, math.ceil(cold_bytes() / max(1, weight_bytes))))
    g = torch.Generator().manual_seed(0)
    layouts: dict[str, list] = {c.name: [] for c in candidates}
    for _ in range(copies):
        w = make_weight(g)
        for c in candidates:
            layouts[c.name].append(c.layout(w))
    del w
    seconds: dict[str, list[float]] = {c.name: [] for c in candidates}
    for m in rows:
        x = make_input(m)
        use = copies if m <= COLD_ROWS else max(1, math.ceil(copies * COLD_ROWS / m))
        passes: dict[str, list[float]] = {c.name: [] for c in candidates}
        first = {}
        for c in candidates:   # first calls build oneDNN's primitives and fault in pages
            t0 = time.perf_counter()
            c.run(layouts[c.name][0], x)
            first[c.name] = time.perf_counter() - t0
        # A candidate whose first call took HOPELESS x the fastest's keeps that time: its passes
        # would cost the most and change nothing (a weight dequantized on every call, say).
        hopeless = {n for n, t in first.items() if t > HOPELESS * min(first.values()) and t > 2e-3}
        for n in hopeless:
            passes[n].append(first[n])
        once = {n for n, t in first.items() if t > LONG_CALL}
        for rep in range(REPS):
            for c in (candidates if rep % 2 == 0 else candidates[::-1]):
                if c.name in hopeless or (rep > 0 and c.name in once):
                    continue
                ws = layouts[c.name][:use]
                t0 = time.perf_counter()
                for w in ws:
                    c.run(w, x)
                passes[c.name].append((time.perf_counter() - t0) / use)
        for c in candidates:
            seconds[c.name].append(statistics.median(passes[c.name]))
    return seconds


@dataclass
class KernelChooser:
    """Times candidates once per machine and op shape, and remembers (in this process and on
    disk) what it found. forced: a candidate name that wins wherever an op has it
    (PAGEDLLM_PREPACK=panels|onednn, for comparisons)."""
    directory: Path
    kernels_build: str | None = None   # the kernels' configuration (flags, torch, CPU: cpu.config_key)
    # The whole build's key (cpu.build_key), which named the verdict files before verdicts were
    # keyed by their own kernel's sources: a verdict found there is moved over, not timed again.
    legacy_build: str | None = None
    forced: str | None = None
    busy_cpus: float = BUSY_CPUS
    memo: dict[str, Verdict] = field(default_factory=dict)
    measured: list[Verdict] = field(default_factory=list)   # since the last take_measured()
    digests: dict[tuple[str, ...], str] = field(default_factory=dict)   # sources' digests, read once

    def path_for(self, mach: dict) -> Path:
        """The file holding the verdicts of machine `mach` (machine())."""
        digest = hashlib.sha256(json.dumps(mach, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{digest}.json"

    def choose(self, op: str, shape: tuple[int, ...], flops_per_row: int, candidates: list[Candidate],
               make_weight: Callable[[torch.Generator], Any], weight_bytes: int,
               make_input: Callable[[int], torch.Tensor], rows: tuple[int, ...] = ROWS,
               gain: float = SECOND_LAYOUT_GAIN, power: int = 1, sources: tuple[str, ...] = ()) -> Verdict:
        """The verdict for `op` on a weight of `shape`; gain: how much faster a path must be at some
        row count to run there beside another (math.inf: one path for all, where the layouts
        cannot live side by side); sources: the csrc/ files of our candidates' kernels (the
        verdict is timed again when they or the headers they include change, and only then;
        none named: when any kernel source changes)."""
        names = [c.name for c in candidates]
        if not candidates:
            raise ValueError(f"no candidate computes {op} {shape}")
        if len(candidates) == 1 or self.forced in names:
            pick = self.forced if self.forced in names else names[0]
            return Verdict(op, shape, flops_per_row, (), {}, Route((pick,)), "only" if len(names) == 1 else "forced",
                           power=power)
        mach = machine(self.kernels_build)
        key = f"{op}/{'x'.join(map(str, shape))}/{','.join(names)}/{','.join(map(str, rows))}"
        if gain != SECOND_LAYOUT_GAIN:   # another gain routes the same timings otherwise
            key += f"/gain={gain}"
        legacy_key = key
        key += f"/src={self._sources_key(sources)}"
        memo_key = f"{mach['threads']}/{key}"
        if memo_key in self.memo:
            return self.memo[memo_key]
        path = self.path_for(mach)
        cached = _read(path).get("verdicts", {}).get(key)
        if cached is None and self.legacy_build is not None:
            # measured on these very sources (the old file is named by all of them): moved over
            old = _read(self.path_for(machine(self.legacy_build))).get("verdicts", {}).get(legacy_key)
            if old is not None:
                cached = _store(path, mach, key, Verdict.from_json(old)).to_json()
        if cached is not None:
            verdict = Verdict.from_json(cached)
        else:
            verdict = self._measure(op, shape, flops_per_row, candidates, make_weight, weight_bytes, make_input, rows,
                                    gain)
            verdict.power = power
            if verdict.source == "measured":
                verdict = _store(path, mach, key, verdict)
            self.measured.append(verdict)
        self.memo[memo_key] = verdict
        return verdict

    def _sources_key(self, sources: tuple[str, ...]) -> str:
        if not sources or self.kernels_build is None:
            return f"build:{self.legacy_build or self.kernels_build}"
        if sources not in self.digests:   # asked at every choice: the files are read once a chooser
            from .cpu import sources_digest
            self.digests[sources] = sources_digest(sources)
        return self.digests[sources]

    def _measure(self, op, shape, flops_per_row, candidates, make_weight, weight_bytes, make_input, rows,
                 gain) -> Verdict:
        cpus = allowed_cpus()
        busy0, own0, t0 = busy_cpu_seconds(cpus), time.process_time(), time.perf_counter()
        seconds = time_candidates(candidates, make_weight, weight_bytes, make_input, rows)
        wall = time.perf_counter() - t0
        busy1, own1 = busy_cpu_seconds(cpus), time.process_time()
        others = 0.0 if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
        source = "measured" if others <= self.busy_cpus else "measured-busy"
        if source != "measured":
            logger.info("kernel choice for %s %s measured while other processes used %.1f CPUs: kept for this "
                        "process only", op, shape, others)
        return Verdict(op, shape, flops_per_row, rows, seconds, route_of(rows, seconds, gain), source, wall)

    def take_measured(self) -> list[Verdict]:
        out, self.measured = self.measured, []
        return out


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _store(path: Path, mach: dict, key: str, verdict: Verdict) -> Verdict:
    """Adds a verdict to the machine's file, under a lock; where another process stored one for
    the same key first (two engines starting at once), that one stands and is returned, so that
    every process on the machine runs the same paths."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read(path) or {"machine": mach, "verdicts": {}}
            if key in data["verdicts"]:
                return Verdict.from_json(data["verdicts"][key])
            data["verdicts"][key] = verdict.to_json()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
    except OSError as e:   # a read-only cache costs a re-measure next start, nothing else
        logger.warning("could not cache the kernel choice in %s: %s", path, e)
    return verdict


_CHOOSER: KernelChooser | None = None


def chooser() -> KernelChooser:
    """The process's chooser. PAGEDLLM_PREPACK=panels|onednn forces that path where an op has it;
    PAGEDLLM_KERNEL_CHOICE_DIR keeps the verdicts elsewhere than ~/.cache/pagedllm/kernel_choice,
    and PAGEDLLM_KERNEL_CHOICE_BUSY_CPUS sets how many CPUs other processes may use during a
    measurement that is cached (the test suite, whose two workers always keep each other busy,
    caches its verdicts in a directory of its own so that all its processes run the same paths)."""
    global _CHOOSER
    forced = os.environ.get("PAGEDLLM_PREPACK", "1").strip().lower()
    directory = Path(os.environ.get("PAGEDLLM_KERNEL_CHOICE_DIR") or cache_root() / "kernel_choice")
    if _CHOOSER is None or _CHOOSER.directory != directory:
        from .cpu import build_key, config_key
        _CHOOSER = KernelChooser(directory, config_key(), build_key())
    _CHOOSER.forced = forced if forced in ("panels", "onednn") else None
    _CHOOSER.busy_cpus = float(os.environ.get("PAGEDLLM_KERNEL_CHOICE_BUSY_CPUS", BUSY_CPUS))
    return _CHOOSER
