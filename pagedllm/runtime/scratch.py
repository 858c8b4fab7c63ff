"""Forwards outside the engine's KV pool, on pools of their own: the profile run that sizes the
pool, the calibration pass of W8A8, and the logits tests compare a model's before and after."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..attention import AttentionBackend, StepLayout
from ..config import EngineConfig
from ..models import ModelConfig
from ..models.state_step import state_steps
from ..util import cdiv

logger = logging.getLogger(__name__)


class ScratchForward:
    def __init__(self, backend: AttentionBackend, device: torch.device, dtype: torch.dtype, mc: ModelConfig) -> None:
        self.backend, self.device, self.dtype, self.mc = backend, device, dtype, mc

    def pools(self, t: int, bs: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any, list[Any] | None]:
        """KV pools of their own for one sequence of t tokens, and its prefill's metadata (and each
        layer's, for a model with state layers: they read theirs from the same blocks)."""
        mc, nblk = self.mc, cdiv(t, bs)
        k_shape, v_shape = self.backend.cache_shapes(nblk, bs, mc.num_kv_heads, mc.head_dim, self.dtype, mc.pool_v_dim)
        pool = self.backend.pool_dtype(self.dtype)
        tmp = [(torch.zeros(k_shape, dtype=pool, device=self.device),
                torch.zeros(v_shape, dtype=pool, device=self.device)) for _ in range(mc.num_layers)]
        meta = self.backend.build_metadata(StepLayout(list(range(t)), [list(range(nblk))], [t], [0, t], 0), self.device)
        if not mc.state_layers:
            return tmp, meta, None
        state, = state_steps([[list(range(nblk))]], [t], [0, t], t, bs, mc.conv_kernel, self.device, mc.state_scans)
        return tmp, meta, [state if i in mc.state_layers else meta for i in range(mc.num_layers)]

    @torch.inference_mode()
    def prefill_logits(self, model, ids: list[int], bs: int) -> torch.Tensor:
        """Logits of one prefill of `ids` through `model`."""
        t = len(ids)
        tmp, meta, layer_meta = self.pools(t, bs)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        return model.compute_logits(model(tokens, torch.arange(t, device=self.device), tmp, meta, layer_meta))

    def calibrate(self, model, model_dir: Path, bs: int, max_tokens: int) -> dict[str, torch.Tensor]:
        """Each matmul's input maxima per channel over one prefill of the calibration text
        (SmoothQuant's statistics, models/smoothing.py), through the float model."""
        from ..loader import load_tokenizer
        from ..models.smoothing import CALIBRATION_TEXT, input_maxima

        ids = load_tokenizer(model_dir).encode(CALIBRATION_TEXT)[:max_tokens]
        return input_maxima(model, lambda: self.prefill_logits(model, ids, bs))

    @torch.inference_mode()
    def profile_activations(self, model, cfg: EngineConfig, rope_rows: int) -> int:
        """Peak bytes a forward of the largest step takes beyond the weights (vLLM's profile
        run, on a GPU): max_num_batched_tokens in one prefill, then the logits of max_num_seqs
        rows. What is left of the budget goes to KV blocks."""
        t, dev = cfg.max_num_batched_tokens, self.device
        tmp, meta, layer_meta = self.pools(t, cfg.block_size)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        hidden = model(torch.zeros(t, dtype=torch.long, device=dev), torch.arange(t, device=dev) % rope_rows, tmp, meta,
                       layer_meta)
        model.compute_logits(hidden[:min(t, cfg.max_num_seqs)]).float()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del tmp, hidden
        torch.cuda.empty_cache()
        logger.info("profile run: %d tokens need %.2f GiB of activations", t, peak / 2**30)
        return peak
