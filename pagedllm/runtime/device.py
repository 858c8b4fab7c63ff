"""Where a runner computes: its device and dtype, and on a CPU its threads and compiled kernels."""
from __future__ import annotations

import logging
import os

import torch

from ..config import EngineConfig, canonical_dtype
from ..distributed import TPGroup
from ..kernels import load_ops
from ..util import cpu_flags
from .threads import ThreadGovernor, resolve_num_threads

logger = logging.getLogger(__name__)


def cpu_has_native_bf16() -> bool:
    return bool((cpu_flags() or set()) & {"avx512_bf16", "amx_bf16"})


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, canonical_dtype(name))
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def rank_device(device: torch.device, tp: TPGroup) -> torch.device:
    """Each rank of a machine on its own GPU."""
    if device.type != "cuda" or tp.size == 1:
        return device
    device = torch.device("cuda", tp.local_rank)
    torch.cuda.set_device(device)
    return device


def thread_governor(cfg: EngineConfig, tp: TPGroup) -> ThreadGovernor:
    """The CPU threads this rank computes on (--num-threads, or the physical cores, shared by
    the machine's ranks), dropped while other processes use the cores."""
    n, source = resolve_num_threads(cfg.num_threads)
    if tp.local_size > 1 and source == "physical cores":  # the machine's ranks share its cores
        n, source = max(1, n // tp.local_size), f"physical cores / {tp.local_size} local ranks"
    # PAGEDLLM_ADAPT_THREADS=0 keeps n threads whatever the neighbours do (to measure it).
    # Under tensor parallelism the busy neighbours are our own ranks: keep n.
    adapt = os.environ.get("PAGEDLLM_ADAPT_THREADS", "1") != "0" and tp.local_size == 1
    if tp.is_driver:
        logger.info("CPU: %d threads%s (%s; --num-threads or OMP_NUM_THREADS to change)", n,
                    " per rank" if tp.size > 1 else "", source)
    return ThreadGovernor(n, enabled=adapt)


def cpu_kernels():
    """torch.ops of the compiled CPU kernels (fused norm, SiLU, RoPE), or None with a
    warning where they cannot be built: the model then runs plain torch ops."""
    try:
        return load_ops()
    except RuntimeError as e:
        logger.warning("%s; running the model's norms, SiLU and RoPE as plain torch ops", e)
        return None


def attach_shared_memory(tp: TPGroup, kernels) -> None:
    """The CPU ranks of one machine add up through shared memory (PAGEDLLM_TP_SHM=0: gloo)."""
    from ..distributed import shm

    wanted = tp.local_size == tp.size and os.environ.get("PAGEDLLM_TP_SHM", "1") != "0"
    via = "shared memory" if shm.attach(tp, kernels, wanted) else "gloo"
    if tp.is_driver:
        logger.info("tensor parallel: all-reduce through %s", via)
