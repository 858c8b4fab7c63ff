"""The built model readied for this engine: quantized (calibrated first for W8A8), its adapter
layers named, made batch-invariant, its weights packed for the kernels the chooser timed."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..config import EngineConfig
from ..distributed import TPGroup
from ..kernels.chooser import chooser
from ..lora.batch import name_lora_layers
from ..models import ModelConfig
from ..models.prepack import describe_paths
from .host_pages import weights_to_huge_pages
from .scratch import ScratchForward

logger = logging.getLogger(__name__)


def check_moe(cfg: EngineConfig, mc: ModelConfig) -> None:
    """What a mixture of experts does not run yet: its experts run float (bf16, fp32) or on weight-only
    blocks (int8, int4, a GGUF file's), not batch-invariant, without adapters."""
    why = "batch_invariant" if cfg.batch_invariant else "enable_lora" if cfg.enable_lora else None
    if why:
        raise ValueError(f"{why} is not supported with a mixture of experts ({mc.model_type}) yet: its experts "
                         "run as float matmuls (bf16 or fp32), on weight-only blocks (quantization int8, int4 or "
                         "gguf) or W8A8, not batch-invariant, without adapters")


def check_quantization(cfg: EngineConfig, mc: ModelConfig) -> None:
    """What a quantization does not run on yet, refused before any weight is read: W8A8's SmoothQuant
    folds its scales into each layer's attention and MLP norms, which a hybrid's state layers
    (convolutions, Mamba-2, DeltaNet) and Nemotron-H's MLP blocks are not built like."""
    if cfg.quantization == "w8a8" and (mc.state_layers or mc.trailing_mlps):
        raise ValueError(f"quantization w8a8 is not supported for {mc.model_type} yet: SmoothQuant's scales fold into "
                         "attention and MLP layers' norms, which its state layers are not; weight-only int8 and "
                         "int4 run it")


def ready_model(model, cfg: EngineConfig, model_dir: Path, mc: ModelConfig, tp: TPGroup, device: torch.device,
                scratch: ScratchForward, rope_rows: int, t0: float) -> None:
    """Quantize, name adapter layers, make batch-invariant and prepack `model` in place, as `cfg`
    asks, and log how it was loaded (t0: when loading began)."""
    if cfg.quantization is not None:
        if device.type != "cpu":
            raise ValueError(f"quantization {cfg.quantization!r} runs on the CPU only, not on {device}")
        gguf = None
        if cfg.quantization == "gguf":
            from ..loader.gguf_quant import model_gguf_blocks
            gguf = model_gguf_blocks(cfg.model, mc)
        maxima = scratch.calibrate(model, model_dir, cfg.block_size, rope_rows) if cfg.quantization == "w8a8" else None
        done = model.quantize(cfg.quantization, gguf, maxima)
        if tp.is_driver:
            logger.info("quantized: %s", done)
    if cfg.enable_lora:
        name_lora_layers(model)
    # After quantizing: w8a8's matmuls are batch-invariant as they are, what stays float is packed.
    invariant = model.make_batch_invariant() if cfg.batch_invariant else None
    packed = model.prepack()
    paged = weights_to_huge_pages(model)   # the packed copies included; CPU tensors only
    log = logger.info if tp.is_driver else logger.debug
    if paged:
        log("weights on 2 MiB pages: %.2f GiB", paged / 2**30)
    log("model loaded in %.1f s (%s, %s, %s attention%s%s)", time.perf_counter() - t0, scratch.dtype, device,
        scratch.backend.name, f"; batch-invariant: {invariant}, no split-K attention" if invariant else "",
        f"; matmuls {describe_paths(model)}" if packed else "")
    measured = chooser().take_measured()
    if measured:
        log("kernel choice: %d matmul shapes timed on this CPU in %.1f s, %s (`pagedllm env` prints them)",
            len(measured), sum(v.measure_s for v in measured),
            "cached for later starts" if all(v.source == "measured" for v in measured)
            else "not cached: other processes were using the CPUs")
