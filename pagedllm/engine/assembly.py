"""The engine's parts built from its config: the runner on the model's weights (with its
tensor-parallel workers), and the KV manager over the runner's pool, layer groups and tier."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config import EngineConfig
from ..kv import KVCacheManager, OffloadConnector
from ..models import ModelConfig
from .runner_api import Runner
from .speculative import SpecPolicy

logger = logging.getLogger(__name__)
# Prompt logprobs kept beside cached blocks, unless --prompt-logprobs-cache-memory says otherwise:
# at most this share of the KV pool's bytes (they live outside it), and never less than the floor
# (a small pool would otherwise keep too few entries to serve a shared few-shot prefix).
SCORE_CACHE_SHARE, SCORE_CACHE_FLOOR = 0.05, 64 * 2**20


def model_runner(cfg: EngineConfig, model_dir: Path, mc: ModelConfig, max_model_len: int):
    """(a ModelRunner on the model's weights, the launcher of its tensor-parallel workers or None)."""
    from ..runtime.model_runner import ModelRunner  # torch stays out of the pure parts

    launcher, tp = None, None
    # PAGEDLLM_TP_GROUP=1: a process group even of one rank, so the GPU check runs
    # the collectives' code path on its one device.
    if cfg.tensor_parallel_size > 1 or os.environ.get("PAGEDLLM_TP_GROUP") == "1":
        if cfg.distributed_executor_backend == "ray":
            from ..runtime.ray_launch import start_ray_group as start_group
        else:
            from ..runtime.launch import start_group

        mc.check_tensor_parallel(cfg.tensor_parallel_size, cfg.enable_expert_parallel)
        launcher = start_group(cfg, model_dir, mc, max_model_len)
        tp = launcher.group
    try:
        return ModelRunner(cfg, model_dir, mc, max_model_len, tp), launcher
    except BaseException:
        if launcher is not None:
            launcher.close(graceful=False)
        raise


def kv_manager(cfg: EngineConfig, runner: Runner, model_dir: Path, max_model_len: int) -> KVCacheManager:
    """The KV manager over the runner's pool, its layer groups and its tier."""
    spec = cfg.speculative_config
    # A step's slots for one sequence: its chunk (drafts included) within the budget, and lookahead slots past it.
    lookahead = SpecPolicy.of(spec).num_lookahead_tokens if spec is not None else 0
    connector = None
    if cfg.kv_offload is not None:
        store = runner.attach_tier(cfg, model_dir)
        connector = OffloadConnector(store, cfg.kv_offload_write_policy)
        size = store.snapshot().capacity_bytes
        logger.info("KV tier: %s, %s, %s, %d bytes a block", getattr(store, "dir", None) or cfg.kv_offload,
                    cfg.kv_offload_write_policy, f"up to {size / 2**30:.1f} GiB" if size else "the server's bound",
                    store.block_bytes)
    scores = cfg.prompt_logprobs_cache_memory
    if scores is None:
        scores = max(int(SCORE_CACHE_SHARE * runner.num_blocks * runner.bytes_per_block), SCORE_CACHE_FLOOR)
    kv = KVCacheManager(runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.allocation,
                        max_model_len, max_step_tokens=cfg.max_num_batched_tokens + lookahead,
                        connector=connector, group_windows=runner.kv_layout.windows, score_cache_bytes=scores,
                        group_kinds=runner.kv_layout.kinds)
    if len(kv.groups) > 1 or any(g.window for g in kv.groups):
        logger.info("KV layer groups %s: each sequence releases its windowed groups' blocks below their windows, "
                    "and its state groups' below the state its next token reads", ", ".join(g.kind for g in kv.groups))
    return kv


def warn_if_pool_short(cfg: EngineConfig, kv: KVCacheManager, weights, max_model_len: int) -> None:
    """vLLM refuses to start when one max_model_len sequence cannot fit the KV pool; here such a
    sequence is refused when it asks (RequestRules), so the start only warns, naming the figures
    that decide it: the pool left beside the weights as loaded (all experts of a mixture)."""
    if not kv.shape.can_ever_fit(max_model_len):
        tokens = kv.shape.num_blocks * cfg.block_size
        logger.warning("max_model_len %d does not fit the KV pool's %d tokens (%d blocks of %d), beside %.2f GiB "
                       "of weights%s: a request longer than the pool is refused; give kv_cache_memory more or "
                       "lower max_model_len", max_model_len, tokens, kv.shape.num_blocks,
                       cfg.block_size, weights.resident / 2**30,
                       f" ({weights.active / 2**30:.2f} GiB read a token)" if weights.active != weights.resident else "")
