"""Builds the CPU kernels (csrc/: paged attention, fused norm / SiLU / RoPE, sampling, prompt scoring, the
batch-invariant matmul, the bf16 matmul on panels, the quantized-block matmuls, W8A8's
quantize and scale passes) once, caches them, loads them as torch.ops.pagedllm_cpu.

The library is compiled for this CPU (-march=native) by torch's extension builder (g++,
ninja) and cached under ~/.cache/pagedllm/ext/ keyed by the sources, torch version, flags
and CPU, so a later start only loads the .so (milliseconds). `scripts/install.sh` builds
it, so the first `pagedllm generate` does not wait for the compiler.

A build after an edit of the sources compiles only what the edit touches: each configuration
(torch, flags, CPU) keeps one working folder of objects, and the sources are mirrored into it
writing only the files whose bytes changed, so that ninja (which goes by times, and a fresh
clone gives every file a new one) sees the others as they were. An edit of panel_linear.cpp
recompiles that file and links, not the attention kernel's instantiations (most of a full build).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import time
from functools import lru_cache
from pathlib import Path

import torch

from ..util import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "attention.cpp", CSRC / "elementwise.cpp", CSRC / "linear.cpp", CSRC / "quant_linear.cpp",
           CSRC / "sampling.cpp", CSRC / "scoring.cpp", CSRC / "shm_allreduce.cpp", CSRC / "grammar_mask.cpp",
           CSRC / "w8a8.cpp", CSRC / "lora.cpp", CSRC / "moe.cpp", CSRC / "panel_linear.cpp", CSRC / "state_scans.cpp",
           CSRC / "state_mixers.cpp", CSRC / "latent_attention.cpp"]


def _arch_flags() -> list[str]:
    """Code for this CPU; PAGEDLLM_CPU_ARCH picks another x86 level (the tests build an
    AVX2-only copy with it, to check the code path of CPUs without AVX-512)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        arch = os.environ.get("PAGEDLLM_CPU_ARCH", "native")
        return [f"-march={arch}", "-mprefer-vector-width=512"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def compiled_head_dims() -> tuple[int, ...]:
    """The head dims the attention kernel is built for. PAGEDLLM_KERNEL_HEAD_DIMS=64,128 builds
    those only: each is about a seventh of the build's compile time (the test suite builds its
    AVX2-only copy so, for the one head dim that copy's check runs)."""
    raw = os.environ.get("PAGEDLLM_KERNEL_HEAD_DIMS", "").strip()
    if not raw:
        return HEAD_DIMS
    try:
        dims = tuple(sorted({int(x) for x in raw.split(",") if x.strip()}))
    except ValueError:
        dims = ()
    if not dims or any(d not in HEAD_DIMS for d in dims):
        raise ValueError(f"PAGEDLLM_KERNEL_HEAD_DIMS must be a comma list of {HEAD_DIMS}, got {raw!r}")
    return dims


def _head_dim_flags() -> list[str]:
    dims = compiled_head_dims()
    return [] if dims == HEAD_DIMS else [f"-DPAGEDLLM_HEAD_DIMS={','.join(map(str, dims))}"]


CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=fast", "-Wno-unused-function", *_arch_flags(),
          *_head_dim_flags()]


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _sources() -> list[Path]:
    """Every file of csrc/ (the compiled sources and the headers they include)."""
    return sorted(p for p in CSRC.iterdir() if p.is_file())


def _config_parts() -> list[bytes]:
    """What decides the compiler's output beside the sources' bytes: the compiled files, torch,
    the flags and the CPU."""
    return [part.encode() for part in (" ".join(p.name for p in SOURCES), torch.__version__, " ".join(CFLAGS),
                                       _cpu_signature())]


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def config_key() -> str:
    """What names a configuration's working folder of objects: flags, torch and CPU."""
    return _digest(_config_parts())


def build_key() -> str:
    """What names this machine's build of the library: its sources, flags, torch and CPU."""
    return _digest([p.read_bytes() for p in _sources()] + _config_parts())


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources_digest(names: tuple[str, ...]) -> str:
    """A digest of the csrc/ files `names` and every local header they include, transitively:
    what a kernel of those files computes with (the kernel chooser keys its verdicts by it, so
    an edit of another file does not send it timing this kernel again)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [inc for inc in _INCLUDE.findall((CSRC / name).read_text()) if (CSRC / inc).is_file()]
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    return h.hexdigest()[:16]


def mirror_sources(into: Path) -> list[str]:
    """csrc/ copied into `into`, writing only the files whose bytes differ from the copy there
    (and removing files csrc/ no longer has): an unchanged file keeps its old time, so ninja
    does not compile it again. Returns the names written."""
    into.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p.read_bytes() for p in _sources()}
    for old in into.iterdir():
        if old.name not in wanted:
            old.unlink()
    written = []
    for name, data in wanted.items():
        dest = into / name
        if not dest.exists() or dest.read_bytes() != data:
            tmp = into / f".{name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, dest)
            written.append(name)
    return written


@lru_cache(maxsize=1)
def load_ops():
    """torch.ops.pagedllm_cpu, building the library first if this machine has no copy.
    Raises RuntimeError saying why when it cannot be built (no compiler, say)."""
    import fcntl

    key = build_key()
    name = f"pagedllm_cpu_{key}"
    build_dir = cache_root() / "ext" / name
    lib = build_dir / f"{name}.so"
    if lib.exists():
        torch.ops.load_library(str(lib))
        return torch.ops.pagedllm_cpu
    build_dir.mkdir(parents=True, exist_ok=True)
    # One build at a time per copy, under a lock the kernel drops when its holder dies.
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if lib.exists():  # built by another process while this one waited
            torch.ops.load_library(str(lib))
            return torch.ops.pagedllm_cpu
        _build(lib)   # torch's builder loads what it built: loading the copy too would register the ops twice
    return torch.ops.pagedllm_cpu


def _build(lib: Path) -> None:
    """Compiles the library in this configuration's working folder (what the sources' edit
    touched, all of it the first time) and copies it to `lib`."""
    import fcntl
    import shutil

    work = cache_root() / "ext" / f"work_{config_key()}"
    work.mkdir(parents=True, exist_ok=True)
    # Builds of other sources in the same configuration share the folder: one at a time.
    with open(work / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        # torch's own lock file stays behind when a build is killed, and every later start then
        # waited on it forever: holding ours, any such file is stale.
        (work / "lock").unlink(missing_ok=True)
        changed = mirror_sources(work / "src")
        t0 = time.perf_counter()
        logger.info("compiling the CPU kernels (%s; a few minutes on 2 cores the first time) in %s",
                    ", ".join(changed) or "nothing changed", work)
        try:
            from torch.utils.cpp_extension import load
            # One name for every build of this configuration: it is in each object's command
            # line, and another name would make ninja compile everything again.
            load(name="pagedllm_cpu", sources=[str(work / "src" / p.name) for p in SOURCES], extra_cflags=CFLAGS,
                 extra_ldflags=["-fopenmp"], build_directory=str(work), is_python_module=False,
                 verbose=bool(os.environ.get("PAGEDLLM_VERBOSE_BUILD")))
        except Exception as e:  # compiler missing, headers missing, ninja missing...
            raise RuntimeError(f"could not build the CPU kernels ({type(e).__name__}: {e}); "
                               "install g++ and ninja, or use --attention-backend torch") from e
        built = work / "pagedllm_cpu.so"
        newest = max((work / "src" / p.name).stat().st_mtime_ns for p in _sources())
        if built.stat().st_mtime_ns < newest:
            # torch's builder skips the build when this process asked for one before (it failed:
            # no ninja, a compile error) and loads the library already there, of older sources:
            # copied, it would stand for these sources in every later start.
            raise RuntimeError("could not build the CPU kernels: an earlier build in this process failed, and "
                               f"{built} is older than the sources; start a new process")
        tmp = lib.with_suffix(".so.tmp")
        shutil.copyfile(built, tmp)
        os.replace(tmp, lib)   # atomic: a process starting now loads a whole library or builds
        logger.info("CPU kernels built in %.0f s", time.perf_counter() - t0)


def cpu_kernels_available() -> str | None:
    """None if the CPU kernels load (building them if needed), else why not."""
    try:
        load_ops()
    except RuntimeError as e:
        return str(e)
    return None
