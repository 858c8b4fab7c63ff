"""The attention backend a runner reads its KV pools with: the one asked for (or the best that
runs here), told how the pools store K/V and how this engine plans its work."""
from __future__ import annotations

import logging

import torch

from ..attention import AttentionBackend, get_backend, pick_backend
from ..config import EngineConfig
from ..kv_dtype import resolve_kv_dtype
from ..models import ModelConfig
from .threads import ThreadGovernor

logger = logging.getLogger(__name__)


def attention_backend(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, mc: ModelConfig,
                      threads: ThreadGovernor | None) -> AttentionBackend:
    """The backend for this engine: its KV dtype set, its split-K planned for the engine's thread
    count, one path whatever the batch under batch_invariant. ValueError naming what cannot run."""
    backend = _make_backend(cfg.attention_backend, device.type, mc)
    _use_kv_dtype(backend, cfg.kv_cache_dtype, dtype, mc)
    if threads is not None and hasattr(backend, "plan_threads"):
        backend.plan_threads = threads.max_threads   # the governor's changes change no sum's order
    if cfg.batch_invariant:
        if backend.name != "cpu" or device.type != "cpu":
            raise ValueError(f"batch_invariant needs the compiled CPU attention kernel, but this engine runs "
                             f"{backend.name} attention on {device.type}")
        backend.split_k = False
        backend.fresh_prefill = False   # every chunk on the paged kernel: one path whatever the batch
    if getattr(backend, "fresh_prefill", False) and backend.kv is None and mc.mla is None:   # timed now, not in a request's first step
        backend.fresh_route(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype)
    if backend.name == "triton" and device.type == "cpu":
        logger.warning("the Triton backend on CPU runs under Triton's interpreter: correct but very slow "
                       "(meant for tests); use --attention-backend torch")
    return backend


def _make_backend(name: str, device: str, mc: ModelConfig) -> AttentionBackend:
    """The attention backend asked for; auto on CPU falls back to the torch reference,
    with a warning, where the compiled kernel cannot be built or cannot run this model."""
    chosen = pick_backend(name, device)
    if chosen == "cpu" and device != "cpu":
        raise ValueError(f"attention backend cpu runs on the CPU only, not on {device}")
    try:
        backend = get_backend(chosen)
        backend.check_model(mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.pool_v_dim, mc.sinks)
        return backend
    except ValueError as e:
        if name != "auto" or chosen != "cpu":
            raise
        logger.warning("%s; using the torch reference attention instead", e)
        return get_backend("torch")


def _use_kv_dtype(backend: AttentionBackend, name: str, dtype: torch.dtype, mc: ModelConfig) -> None:
    """Tell the backend how its pools store K/V (--kv-cache-dtype); ValueError at start-up
    for a kind it cannot read or this model's heads cannot pack."""
    computed = str(dtype).removeprefix("torch.")
    kv = resolve_kv_dtype(name, computed)
    if not kv.quantized and kv.name != computed:
        raise ValueError(f"kv_cache_dtype {kv.name} stores K/V unquantized, as the model computes them, but dtype "
                         f"is {computed}: use --dtype {kv.name}, or a quantized kind (fp8, fp8_e5m2, int8, int4)")
    if kv.quantized and mc.mla is not None:
        raise ValueError(f"kv_cache_dtype {kv.name} is not supported for {mc.model_type}: its multi-head latent "
                         "attention keeps the latent unquantized; use kv_cache_dtype auto")
    kv.check_head_dim(mc.head_dim)
    backend.use_kv_dtype(kv)
