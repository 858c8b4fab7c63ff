"""Owns the tensors: weights, KV pools, per-step batch tensors. Executes what the
scheduler decided and returns one sampled token per sequence that reached its end."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..attention import AttentionMetadata, PrefillSeq, get_backend, length_groups, pad_rows, pick_backend
from ..config import EngineConfig
from ..engine.scheduler import SchedulerOutput
from ..kv import KVCacheManager
from ..loader import load_weights
from ..models import LlamaForCausalLM, ModelConfig
from ..models.rope import RotaryEmbedding
from .kv_cache import KVCache
from .sampler import sample

logger = logging.getLogger(__name__)

# Decode attention runs in groups this size: padding each group only to its own longest
# context, and keeping a group's K/V within cache, was ~4x faster on a 2-core CPU than
# one batch of 100 padded to the longest.
DECODE_GROUP = 24

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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
        return _DTYPES[name]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int) -> None:
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.block_size = cfg.block_size
        t0 = time.perf_counter()
        backend = get_backend(pick_backend(cfg.attention_backend, self.device.type))
        self.backend_name = backend.name
        if backend.name == "triton" and self.device.type == "cpu":
            logger.warning("the Triton backend on CPU runs under Triton's interpreter: correct but very slow "
                           "(meant for tests); use --attention-backend torch")
        with torch.device("meta"):  # no random init of weights we overwrite anyway
            model = LlamaForCausalLM(model_cfg, backend)
        model = model.to_empty(device=self.device)
        if model_cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.load_hf_weights(load_weights(model_dir))
        model = model.to(self.dtype).eval()
        # RoPE tables stay float32 whatever the weights' dtype.
        model.rope = RotaryEmbedding(model_cfg.head_dim, model_cfg.max_position_embeddings,
                                     model_cfg.rope_theta, model_cfg.rope_scaling).to(self.device)
        self.model = model
        logger.info("model loaded in %.1f s (%s, %s, %s attention)", time.perf_counter() - t0, self.dtype,
                    self.device, backend.name)
        self.kv_cache = KVCache(model_cfg, cfg, self.dtype, self.device,
                                profile=lambda: self._profile_activations(cfg, model_cfg))
        self.max_model_len = max_model_len
        self.graphs = None
        if self.device.type == "cuda" and backend.name == "triton" and not cfg.enforce_eager:
            from .cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, cfg.max_num_seqs, self.max_model_len,
                                       cfg.block_size, self.device)
            self.graphs.capture()

    @torch.inference_mode()
    def _profile_activations(self, cfg: EngineConfig, mc: ModelConfig) -> int:
        """Peak bytes a forward of the largest step takes beyond the weights (vLLM's
        profile run): max_num_batched_tokens in one prefill, then the logits of
        max_num_seqs rows. What is left of the budget goes to KV blocks."""
        t = cfg.max_num_batched_tokens
        nblk = -(-t // cfg.block_size)
        shape = (nblk, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        tmp = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(mc.num_layers)]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(t, device=dev), num_decodes=0, decode_block_tables=None,
            decode_context_lens=None, decode_max_context=0,
            prefills=[PrefillSeq(0, t, t, torch.arange(nblk, device=dev))])
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        hidden = self.model(torch.zeros(t, dtype=torch.long, device=dev),
                            torch.arange(t, device=dev) % mc.max_position_embeddings, tmp, meta)
        self.model.compute_logits(hidden[:min(t, cfg.max_num_seqs)]).float()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del tmp, hidden
        torch.cuda.empty_cache()
        logger.info("profile run: %d tokens need %.2f GiB of activations", t, peak / 2**30)
        return peak

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[dict[int, int], dict]:
        self.kv_cache.copy_blocks(out.copies)
        # Single-token queries first, shortest context first: they attend in padded
        # groups of similar length.
        order = sorted(out.scheduled, key=lambda s: (s.num_tokens != 1, s.start))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        logit_rows: list[int] = []
        sample_rows = []
        dev = self.device
        for s in order:
            table = kv.block_table(s.seq.seq_id)
            end = s.start + s.num_tokens
            q_start = len(ids)
            ids.extend(s.seq.token_ids[s.start:end])
            positions.extend(range(s.start, end))
            slots.extend(table.slots(s.start, end))
            nblk = -(-end // self.block_size)
            if s.num_tokens == 1:
                decode_tables.append(table.block_ids[:nblk])
                decode_lens.append(end)
            else:
                prefills.append(PrefillSeq(q_start, s.num_tokens, end,
                                           torch.tensor(table.block_ids[:nblk], device=dev)))
            if s.sample_for:
                logit_rows.append(len(ids) - 1)
                sample_rows.append(s.sample_for)
        if self.graphs is not None and not prefills and self.graphs.fits(len(decode_lens)):
            hidden = self.graphs.run(ids, positions, slots, decode_tables, decode_lens)
            return self._sample(hidden, logit_rows, sample_rows)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev), num_decodes=len(decode_lens),
            decode_block_tables=pad_rows(decode_tables, dev) if decode_lens else None,
            decode_context_lens=torch.tensor(decode_lens, device=dev) if decode_lens else None,
            decode_max_context=max(decode_lens, default=0), prefills=prefills,
            decode_groups=length_groups(decode_lens, DECODE_GROUP))
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            self.kv_cache.layers, meta)
        return self._sample(hidden, logit_rows, sample_rows)

    def _sample(self, hidden: torch.Tensor, logit_rows: list[int], sample_rows: list) -> tuple[dict[int, int], dict]:
        if not logit_rows:
            return {}, {}
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=hidden.device)])
        return sample(logits, sample_rows)
