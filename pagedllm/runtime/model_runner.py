"""Owns the tensors: weights, KV pools, per-step batch tensors. Executes what the scheduler
decided and returns one sampled token per sequence that reached its end.

The runner composes jobs, each in a module of its own: where it computes (device.py), the
attention backend (backend_setup.py), the model built and readied (build.py, prepare.py), the
KV pools (kv_cache.py, laid out by kv.groups), LoRA's pages (adapter_pager.py), the tier's IO
(kv_tier.py), the step's inputs (step_inputs.py), token picking (token_picker.py) and prompt
scores (prompt_scores.py). Here they meet: a step's plan in, its StepResult out."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..config import EngineConfig
from ..distributed import TPGroup
from ..kv import KVLayout
from ..kv.connector import BlockStore
from ..kv.groups import engine_layout
from ..loader import resolve_model_dir
from ..models import ModelConfig
from ..models.footprint import WeightBytes, weight_bytes
from ..plan import StepPlan, StepResult
from .adapter_pager import AdapterPager, check_adapters
from .backend_setup import attention_backend
from .build import build_model, rope_rows
from .device import attach_shared_memory, cpu_kernels, rank_device, resolve_device, resolve_dtype, thread_governor
from .kv_cache import KVCache, check_state_model
from .kv_tier import TierIO, open_tier
from .prepare import check_moe, check_quantization, ready_model
from .prompt_scores import score_prompt, split_scores
from .scratch import ScratchForward
from .spec_decode import make_proposer
from .step_inputs import StepInputs, group_metas, step_bucket, step_inputs
from .token_picker import TokenPicker

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int,
                 tp: TPGroup | None = None) -> None:
        """model_cfg: the whole model; under tensor parallelism (tp) this rank builds and
        loads its slice of it and the KV pool of its KV heads."""
        self.tp = tp = tp or TPGroup()
        self.model_cfg = model_cfg = model_cfg.shard(tp.size, cfg.enable_expert_parallel)
        self.model_dir, self.max_model_len = model_dir, max_model_len
        self.device = rank_device(resolve_device(cfg.device), tp)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        cpu = self.device.type == "cpu"
        self.threads = thread_governor(cfg, tp) if cpu else None
        # What min_tokens keeps from being sampled too early; the engine adds the tokenizer's.
        self.eos_token_ids = frozenset(model_cfg.eos_token_ids)
        t0 = time.perf_counter()
        self.backend = backend = attention_backend(cfg, self.device, self.dtype, model_cfg, self.threads)
        self.backend_name, self.batch_invariant = backend.name, cfg.batch_invariant
        # oneDNN builds a kernel per matmul shape on first use (5-25 ms each): padding the
        # step's token count to a few buckets bounds how many a run ever builds, so a cold
        # process runs as fast as a warm one. The cpu backend leaves padding rows alone.
        # Batch-invariant matmuls build nothing per shape (or run one tile shape): no padding.
        self.pad_steps = backend.name == "cpu" and not cfg.batch_invariant
        kernels = cpu_kernels() if cpu else None
        if model_cfg.moe is not None:
            check_moe(cfg, model_cfg)
        check_quantization(cfg, model_cfg)
        if tp.distributed and tp.size > 1 and cpu:
            attach_shared_memory(tp, kernels)
        if cfg.enable_lora:   # before the weights are read: a refusal costs nothing
            check_adapters(cfg, model_cfg, self.device, self.dtype, kernels)
        self.model = build_model(model_dir, model_cfg, backend, kernels, tp, self.device, self.dtype, max_model_len)
        self.rope_rows = rope_rows(model_cfg, max_model_len)
        self.scratch = ScratchForward(backend, self.device, self.dtype, model_cfg)
        ready_model(self.model, cfg, model_dir, model_cfg, tp, self.device, self.scratch, self.rope_rows, t0)
        self._greedy_head = self.model.greedy_head()   # greedy rows' tokens from the head's argmax kernel
        self.picker = TokenPicker(kernels)
        self.draft = self._draft_runner(cfg, kernels)
        self.kv_layout = self._kv_layout(cfg)
        # Each layer's group: its block tables and slots (one metadata per group per step).
        self.layer_groups = [self.kv_layout.place(i)[0] for i in range(model_cfg.num_layers)]
        self.kv_cache = KVCache(model_cfg, cfg, self.dtype, self.device, backend,
                                profile=lambda: self.scratch.profile_activations(self.model, cfg, self.rope_rows),
                                tp=tp, extra_bytes_per_token=self.draft.bytes_per_token if self.draft else 0,
                                layout=self.kv_layout)
        if self.kv_layout.has_state:
            check_state_model(cfg, model_cfg, self.kv_cache)
        if self.draft is not None:  # the draft's pool mirrors the target's blocks: one block table for both
            self.draft.allocate(self.kv_cache.num_blocks, cfg.block_size)
        # LoRA adapters: read into host memory, paged into the pool's blocks, read from there by the kernel.
        self.adapters = AdapterPager(cfg, model_cfg, self.kv_cache, self.dtype, tp, kernels) \
            if cfg.enable_lora else None
        # Drafts for the next step, proposed after sampling (rank 0 only: it samples).
        spec = cfg.speculative_config
        self.proposer = make_proposer(spec, self.draft) if spec is not None and tp.is_driver else None
        self.tier_io: TierIO | None = None   # the second tier, when the engine opens one
        self.graphs = self._decode_graphs(cfg)

    def _draft_runner(self, cfg: EngineConfig, kernels):
        spec = cfg.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        from .draft import DraftRunner
        if self.tp.size > 1:
            raise ValueError("a draft model with tensor_parallel_size > 1 is not supported")
        return DraftRunner(resolve_model_dir(spec.model), self.backend, kernels, self.device, self.dtype,
                           self.max_model_len)

    def _kv_layout(self, cfg: EngineConfig) -> KVLayout:
        """The KV cache's layer groups (kv.groups.engine_layout): one block table per sequence
        where something reads the pool that way."""
        mc = self.model_cfg
        windows = [mc.window(i) for i in range(mc.num_layers)]
        why = "a draft model shares the block table" if self.draft is not None else \
            "reserve-max reserves one table" if cfg.allocation == "reserve-max" else None
        draft = [self.draft.cfg.window(i) for i in range(self.draft.cfg.num_layers)] if self.draft is not None else []
        layout = engine_layout(windows, why, draft, mc.state_layers)
        if why is not None and any(windows) and not layout.groups[0].window and self.tp.is_driver:
            logger.info("sliding-window layers mask their own windows, but a sequence keeps all its KV blocks (%s "
                        "and a full-attention layer reads every key)", why)
        return layout

    def _decode_graphs(self, cfg: EngineConfig):
        # Decode graphs would capture one rank's collectives: under TP every step runs eagerly.
        if self.device.type != "cuda" or not self.backend.supports_decode_graphs or cfg.enforce_eager \
                or cfg.enable_lora or self.tp.distributed or len(self.kv_layout.groups) != 1:
            return None
        from .cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(self.model, self.backend, self.kv_cache.layers, cfg.max_num_seqs,
                              self.max_model_len, cfg.block_size, self.device)
        graphs.capture()
        return graphs

    def reset_sequences(self) -> None:
        """Forget what is kept per sequence (sampling RNGs, grammar matchers, drafts' state): a
        new engine over this runner numbers its sequences from 0 again."""
        self.picker.reset()
        if self.proposer is not None:
            self.proposer.seqs.clear()

    # -- what the engine reads of the runner -----------------------------------
    @property
    def loras(self):
        """The adapters in host memory (engine.runner_api), or None without enable_lora."""
        return self.adapters.loras if self.adapters is not None else None

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def bytes_per_token(self) -> int:
        """M_KV per token over every layer and rank."""
        return self.kv_cache.bytes_per_token * self.tp.size

    @property
    def bytes_per_block(self) -> int:
        """One pool block over its layer slots and every rank."""
        return self.kv_cache.bytes_per_block * self.tp.size

    @property
    def kv_dtype_name(self) -> str:
        return self.kv_cache.kv_dtype.name

    @property
    def weights(self) -> WeightBytes:
        """The weights held over every rank (each rank its share), and what one token reads."""
        w = weight_bytes(self.model)
        return WeightBytes(w.resident * self.tp.size, w.active * self.tp.size)

    def describe(self) -> str:
        """dtype, device, attention backend, threads and batch-invariant mode, for reports."""
        threads = f", {torch.get_num_threads()} threads" if self.device.type == "cpu" else ""
        mode = ", batch-invariant" if self.batch_invariant else ""
        if self.model.ops.quant is not None:
            mode += f", {self.model.ops.quant} weights ({self.model.quant_summary})"
        tp = f", tensor parallel {self.tp.size} ({'shm' if self.tp.shm is not None else 'gloo'})" \
            if self.tp.size > 1 else ""
        return f"{self.dtype}, {self.device}, {self.backend_name} attention{threads}{mode}{tp}"

    # -- the tier ------------------------------------------------------------
    def attach_tier(self, cfg: EngineConfig, model_dir: Path) -> BlockStore:
        """Open the second tier for this runner's pools (kv_tier.open_tier): the runner copies
        bytes in and out of it."""
        if self.tp.size > 1:
            raise ValueError(f"{cfg.kv_offload_knob} with tensor_parallel_size > 1 is not supported: each rank "
                             "holds a slice of every block")
        pools = [t for pair in self.kv_cache.pools for t in pair]
        if self.draft is not None:
            pools += [t for layer in self.draft.layers for t in layer]
        draft_dir = resolve_model_dir(cfg.speculative_config.model) if self.draft is not None else None
        self.tier_io = open_tier(cfg, model_dir, pools, draft_dir, self.dtype, self.kv_cache.kv_dtype.name,
                                 self.backend_name, self.kv_layout)
        return self.tier_io.store

    def move_blocks(self, plan: StepPlan) -> None:
        """A step that runs no forward still carries out its tier IO (a load for a request
        that then waited, a write that the disk's catching up released), and places its adapters."""
        if self.adapters is not None:
            self.adapters.place(plan)
        if self.tier_io is not None:
            self.tier_io.before_forward(plan.saves, plan.loads)
            self.tier_io.after_forward(plan.writes)

    def write_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Write these (block, key) to the tier now and wait for them (a clean shutdown)."""
        if self.tier_io is not None:
            self.tier_io.after_forward(pairs)
            self.tier_io.store.flush()

    # -- steps ---------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the step: sample, verify drafts, score prompt tokens."""
        if self.threads is not None:
            self.threads.tick()
        self.picker.forget(plan.finished_seq_ids)
        if self.tier_io is not None:  # before any block is written
            self.tier_io.before_forward(plan.saves, plan.loads)
        if self.adapters is not None:
            self.adapters.place(plan)
        if self.draft is not None:  # its pool mirrors the target's blocks: the same copies
            self.draft.copy_blocks(plan.copies)
        step, roles = step_inputs(plan)
        if self.tp.distributed:
            if self.adapters is not None:
                step.adapter_events = self.adapters.take_unsent()
            self.tp.broadcast(step)
        argmax_rows = self.picker.argmax_rows(roles) if self._greedy_head else []
        logits, hidden, scores, greedy = self._forward(step, argmax_rows)
        if self.tier_io is not None:  # their tokens' KV is written now
            self.tier_io.after_forward(plan.writes)
        out = StepResult(prompt_logprobs=split_scores(scores, roles.scored))
        if greedy:
            self.picker.take_greedy(roles, greedy, out)
        if logits is not None:
            self.picker.pick(logits, roles, hidden, self.eos_token_ids, out)
        if self.proposer is not None and (logits is not None or greedy):
            out.drafts = self.proposer.propose(plan, out)
        return out

    @torch.inference_mode()
    def serve(self) -> None:
        """A tensor-parallel rank other than 0: run rank 0's steps until it sends None."""
        while (step := self.tp.broadcast(None)) is not None:
            if self.threads is not None:
                self.threads.tick()
            if self.adapters is not None:
                self.adapters.apply(step.adapter_events)
            self._forward(step)

    def _forward(self, step: StepInputs, argmax_rows: list[int] = ()
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor], dict[int, int]]:
        """The step's forward on this rank: logits of the rows that sample (the whole
        vocabulary on rank 0, None on the other ranks and when nothing samples), those rows'
        hidden states, the scored prompt tokens' logprobs, and the tokens of `argmax_rows`
        (logits rows) where the head gave them without logits ({row: token}); the logits then
        leave those rows out."""
        self.kv_cache.copy_blocks(step.copies)
        nd = step.num_decodes
        if self.graphs is not None and nd == len(step.seq_lens) and self.graphs.fits(nd):
            hidden = self.graphs.run(step.ids, step.positions, step.slots, step.tables, step.seq_lens)
        else:
            hidden = self._eager(step)
        scores = score_prompt(self.model, self.tp, hidden, step) if step.score_rows else []
        if not step.logit_rows:
            return None, None, scores, {}
        rows = sampled = hidden[torch.tensor(step.logit_rows, device=hidden.device)]
        greedy = {}
        if argmax_rows:
            picked = self.model.greedy_tokens(rows[torch.tensor(argmax_rows, device=rows.device)])
            if picked is not None:
                greedy = dict(zip(argmax_rows, picked.tolist()))
                rest = [i for i in range(len(step.logit_rows)) if i not in greedy]
                if not rest:
                    return None, sampled, scores, greedy
                rows = rows[torch.tensor(rest, device=rows.device)]
        return self.tp.gather_vocab(self.model.compute_logits(rows)), sampled, scores, greedy

    def _eager(self, step: StepInputs) -> torch.Tensor:
        """The hidden states of a step run op by op (every step but CUDA graphs' decodes)."""
        ids, positions, slots, group_slots = step.ids, step.positions, step.slots, step.group_slots
        if self.pad_steps:  # padding rows: token 0 at position 0, no slot, in no sequence
            pad = step_bucket(len(ids)) - len(ids)
            ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
            group_slots = [g + [-1] * pad for g in group_slots]
        dev = self.device
        metas = group_metas(self.backend, self.kv_layout, self.model_cfg, step, [slots, *group_slots], len(ids),
                            self.kv_cache.block_size, dev)
        ops = self.model.ops
        ops.lora = self.adapters.step(step.lora_rows, dev) if self.adapters is not None else None
        try:
            return self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                              self.kv_cache.layers, metas[0],
                              [metas[g] for g in self.layer_groups] if len(metas) > 1 else None)
        finally:
            ops.lora = None
