"""OpenVINO GenAI (PyPI `openvino-genai`) as a baseline, in a venv of its own.

Its ContinuousBatchingPipeline runs paged attention on OpenVINO's CPU plugin, on an IR that
`optimum-cli export openvino` writes from the same HF directory our engine and vLLM load.
The bench creates ~/.cache/pagedllm/openvino-genai-<version>/ on request (--setup-openvino):
the CPU torch we run on (the exporter traces the model with it), optimum-intel and
openvino-genai, our torch pin held (peer_venv.py). The IR is exported once per model
(fp32 weights: the plugin then computes in the precision it is asked for, bf16 or f32) and
cached beside the venv.
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from pagedllm.bench.sharegpt import BenchRequest
from pagedllm.util import cache_root
from .peer_venv import create_venv, peer_python, run_worker

logger = logging.getLogger(__name__)

OPENVINO_VERSION = "2026.4.1.0"
OPTIMUM_INTEL_VERSION = "2.2.0"
# Run from a folder of its own, so that no module of ours shadows one of OpenVINO's.
WORKER = Path(__file__).parents[1] / "openvino" / "openvino_worker.py"
# What a caller names: (label, KV_CACHE_PRECISION). bf16 KV is the like-for-like setting
# beside our bf16 pool; u8 (with per-token scales) is OpenVINO's own CPU default.
KV_PRECISIONS = {"bf16": "bf16", "u8": "u8", "f32": "f32"}


def default_venv() -> Path:
    return cache_root() / f"openvino-genai-{OPENVINO_VERSION}"


def openvino_python(venv: Path | None = None, create: bool = False) -> tuple[Path | None, str | None]:
    """(the venv's python, None) when openvino_genai and the exporter import there; (None, why
    not) otherwise. create=True builds the venv first if it is missing (pip downloads ~1 GB once)."""
    return peer_python(venv or default_venv(), "openvino_genai, optimum.intel", _create if create else None,
                       f"pass --setup-openvino to create it: pip install openvino-genai=={OPENVINO_VERSION}")


def _create(venv: Path) -> None:
    create_venv(venv, [f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}", f"openvino-genai=={OPENVINO_VERSION}",
                       f"openvino-tokenizers=={OPENVINO_VERSION}"])


WEIGHT_FORMATS = ("fp32", "int8")  # optimum-cli's --weight-format: int8 is OpenVINO's weight compression


def exported_ir(python: Path, model_dir: Path, weight_format: str = "fp32") -> Path:
    """The model's OpenVINO IR (fp32 weights, or int8-compressed), exported once by optimum-cli
    and cached under the venv, keyed by the HF directory's name (which carries its content
    digest) and the weight format."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    name = Path(model_dir).name + ("" if weight_format == "fp32" else f"-{weight_format}")
    out = python.parents[1] / "ir" / name
    if (out / "openvino_model.xml").is_file():
        return out
    cli = python.parent / "optimum-cli"
    logger.info("exporting %s to OpenVINO IR at %s", model_dir, out)
    p = subprocess.run([str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past",
                        "--weight-format", weight_format, str(out)], capture_output=True, text=True, timeout=1800, check=False)
    if p.returncode != 0 or not (out / "openvino_model.xml").is_file():
        raise RuntimeError(f"optimum-cli export openvino failed (exit {p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
    return out


def run_openvino_offline(reqs: list[BenchRequest], model_dir: Path, python: Path, kv_bytes: int,
                         max_num_batched_tokens: int, max_num_seqs: int, kv: str = "bf16",
                         inference_precision: str = "bf16", timeout: int = 3600,
                         weight_format: str = "fp32") -> list[dict]:
    """OpenVINO GenAI's ContinuousBatchingPipeline on the same token ids, in its own process:
    the cold pass (right after start-up) and the warm one. kv: "bf16", "u8" or "f32";
    weight_format: the IR's weights, "fp32" or "int8" (its weight compression)."""
    if kv not in KV_PRECISIONS:
        raise ValueError(f"kv must be one of {sorted(KV_PRECISIONS)}, got {kv!r}")
    if any(isinstance(r.prompt, str) for r in reqs):
        raise ValueError("the OpenVINO baseline takes token-id prompts (the sharegpt and random workloads)")
    spec = {"ir": str(exported_ir(python, model_dir, weight_format)), "prompts": [list(r.prompt) for r in reqs],
            "output_lens": [r.output_len for r in reqs], "kv_cache_precision": KV_PRECISIONS[kv],
            "inference_precision": inference_precision, "cache_gb": max(1, round(kv_bytes / 2**30)),
            "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs}
    res, _ = run_worker(python, WORKER, spec, {**os.environ, "TOKENIZERS_PARALLELISM": "false"}, timeout,
                        "OpenVINO GenAI")
    prompt_tok = sum(r.prompt_len for r in reqs)
    out = []
    for ps in res["passes"]:
        dt, n = ps["elapsed_s"], ps["output_tokens"]
        weights = "" if weight_format == "fp32" else f"{weight_format} weights, "
        out.append({"engine": f"openvino-genai {res['genai']} ({weights}{inference_precision}, {kv} KV, {ps['pass']})",
                    "num_requests": len(reqs), "elapsed_s": dt, "requests_per_s": len(reqs) / dt,
                    "output_tokens": n, "prompt_tokens": prompt_tok, "output_tok_s": n / dt,
                    "total_tok_s": (n + prompt_tok) / dt, "pass": ps["pass"], "startup_s": res["startup_s"],
                    "openvino": res["openvino"], "kv_cache_precision": kv,
                    "inference_precision": inference_precision, "weight_format": weight_format,
                    "first_tokens": res["tokens"][:4]})
    return out
