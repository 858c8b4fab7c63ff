"""What every result file records about where it was measured."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

# The flags that decide which kernels run (vector width, bf16 dot products, AMX).
_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
          "amx_bf16", "amx_int8", "asimd", "sve", "bf16", "i8mm")


def provenance() -> dict:
    import torch

    root = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                elif ln.startswith(("flags", "Features")):
                    flags |= set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": cpu, "cpu_flags": sorted(f for f in flags if f in _FLAGS), "logical_cpus": os.cpu_count(),
        "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
