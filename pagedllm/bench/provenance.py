"""What every result file records about where it was measured."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

# The flags that decide which kernels run (vector width, bf16 dot products, AMX).
_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
          "amx_bf16", "amx_int8", "asimd", "sve", "bf16", "i8mm")


def _git(*args: str) -> str:
    """git's answer in this checkout; "" outside one, or where git is not installed."""
    root = Path(__file__).resolve().parents[2]
    try:
        run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False)
        return run.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> dict:
    import torch

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
        # "unknown" (not null) outside git, so a reader can tell "not recorded" from "not known".
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": cpu, "cpu_flags": sorted(f for f in flags if f in _FLAGS), "logical_cpus": os.cpu_count(),
        "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def save_result(result: dict | list, path: str) -> None:
    """Write a result file; the one writer of every `bench` JSON. A dict gets this run's
    provenance unless it already carries one (a list, an old shape, is written as it is)."""
    if isinstance(result, dict) and "provenance" not in result:
        result = {**result, "provenance": provenance()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
