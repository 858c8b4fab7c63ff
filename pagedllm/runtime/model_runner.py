"""Owns the tensors: weights, KV pools, per-step batch tensors. Executes what the
scheduler decided and returns one sampled token per sequence that reached its end."""
from __future__ import annotations

import logging
import os
from array import array
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..attention import AttentionBackend, StepLayout, get_backend, pick_backend
from ..config import EngineConfig, canonical_dtype
from ..distributed import TPGroup
from ..kernels import load_ops
from ..kernels.chooser import chooser
from ..kv import KVLayout, kv_layout
from ..kv.groups import merged
from ..kv_dtype import resolve_kv_dtype
from ..loader import resolve_model_dir
from ..models import ModelConfig
from ..models.footprint import WeightBytes, weight_bytes
from ..models.prepack import describe_paths
from ..plan import PromptScores, SampleTarget, StepPlan, StepResult
from ..util import cdiv, cpu_flags
from ..lora.adapter import LoRAAdapter, load_adapter
from ..lora.batch import lora_step, name_lora_layers
from ..lora.paged import AdapterSlabs, PagedAdapter
from ..lora.registry import AdapterCache
from ..lora.request import LoRARequest
from .build import build_model, rope_rows
from .grammar import GrammarMatchers, GrammarRow
from .kv_cache import KVCache
from .kv_tier import BlockBytes, TierIO, kv_fingerprint
from ..kv.connector import BlockStore
from ..kv.tier_store import TierStore
from .rejection import Verify, verify
from .spec_decode import make_proposer
from .sampler import sample
from .threads import ThreadGovernor, resolve_num_threads

logger = logging.getLogger(__name__)
# Prompt rows scored per logits matmul (prompt logprobs): 256 x 49152 float32 is 48 MiB.
SCORE_ROWS = 256


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


def step_bucket(n: int) -> int:
    """Token count a step is padded to: powers of two to 16, then multiples of 16 to 512,
    of 64 to 2048, of 256 beyond (at most 1/8 extra rows past 128 tokens)."""
    if n <= 16:
        return 1 << max(0, n - 1).bit_length()
    step = 16 if n <= 512 else 64 if n <= 2048 else 256
    return cdiv(n, step) * step


def _cpu_kernels():
    """torch.ops of the compiled CPU kernels (fused norm, SiLU, RoPE), or None with a
    warning where they cannot be built: the model then runs plain torch ops."""
    try:
        return load_ops()
    except RuntimeError as e:
        logger.warning("%s; running the model's norms, SiLU and RoPE as plain torch ops", e)
        return None


def _make_backend(name: str, device: str, mc: ModelConfig) -> AttentionBackend:
    """The attention backend asked for; auto on CPU falls back to the torch reference,
    with a warning, where the compiled kernel cannot be built or cannot run this model."""
    chosen = pick_backend(name, device)
    if chosen == "cpu" and device != "cpu":
        raise ValueError(f"attention backend cpu runs on the CPU only, not on {device}")
    try:
        backend = get_backend(chosen)
        backend.check_model(mc.num_heads, mc.num_kv_heads, mc.head_dim)
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
    kv.check_head_dim(mc.head_dim)
    backend.use_kv_dtype(kv)


@dataclass(slots=True)
class StepInputs:
    """What every tensor-parallel rank needs to run a step's forward: rank 0 builds it
    from the plan and broadcasts it (sampling stays on rank 0)."""
    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    seq_lens: list[int]
    q_starts: list[int]
    num_decodes: int
    logit_rows: list[int]
    copies: list[tuple[int, int]]
    # Prompt logprobs: rows that score the next prompt token, that token, the top k asked.
    score_rows: list[int] = field(default_factory=list)
    score_ids: list[int] = field(default_factory=list)
    score_top: list[int] = field(default_factory=list)
    # Layer groups 1.. (kv.groups): their slots and tables (slots and tables above: group 0's).
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[list[int]]] = field(default_factory=list)
    lora_rows: dict[int, list[int]] = field(default_factory=dict)   # adapter id -> its rows (enable_lora)
    # Under tensor parallelism: adapters placed or evicted since the last broadcast, in order:
    # ("load", id, pages, its LoRARequest) / ("evict", id); every rank places its own slice.
    adapter_events: list[tuple] = field(default_factory=list)


def _tp_device(device: torch.device, tp: TPGroup) -> torch.device:
    """Each rank of a machine on its own GPU."""
    if device.type != "cuda" or tp.size == 1:
        return device
    device = torch.device("cuda", tp.local_rank)
    torch.cuda.set_device(device)
    return device



def _argmax_only(t: SampleTarget) -> bool:
    """Whether a sequence's next token is its logits' argmax and nothing else reads them."""
    p = t.params
    return p.greedy and p.logprobs is None and not p.ranks_samples and not p.penalized \
        and not t.beam_candidates and t.grammar is None

class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int,
                 tp: TPGroup | None = None) -> None:
        """model_cfg: the whole model; under tensor parallelism (tp) this rank builds and
        loads its slice of it and the KV pool of its KV heads."""
        self.tp = tp = tp or TPGroup()
        model_cfg = model_cfg.shard(tp.size, cfg.enable_expert_parallel)
        self.device = _tp_device(resolve_device(cfg.device), tp)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.threads = None
        if self.device.type == "cpu":
            n, source = resolve_num_threads(cfg.num_threads)
            if tp.local_size > 1 and source == "physical cores":  # the machine's ranks share its cores
                n, source = max(1, n // tp.local_size), f"physical cores / {tp.local_size} local ranks"
            # PAGEDLLM_ADAPT_THREADS=0 keeps n threads whatever the neighbours do (to measure it).
            # Under tensor parallelism the busy neighbours are our own ranks: keep n.
            adapt = os.environ.get("PAGEDLLM_ADAPT_THREADS", "1") != "0" and tp.local_size == 1
            self.threads = ThreadGovernor(n, enabled=adapt)
            if tp.is_driver:
                logger.info("CPU: %d threads%s (%s; --num-threads or OMP_NUM_THREADS to change)", n,
                            " per rank" if tp.size > 1 else "", source)
        self.block_size = cfg.block_size
        # What min_tokens keeps from being sampled too early; the engine adds the tokenizer's.
        self.eos_token_ids = frozenset(model_cfg.eos_token_ids)
        # Each sampling sequence's RNG, seeded on first use, kept until it finishes.
        self.generators: dict[int, torch.Generator] = {}
        # Structured outputs: each constrained sequence's grammar matcher (sampling is here).
        self.grammars: GrammarMatchers | None = None
        t0 = time.perf_counter()
        backend = _make_backend(cfg.attention_backend, self.device.type, model_cfg)
        _use_kv_dtype(backend, cfg.kv_cache_dtype, self.dtype, model_cfg)
        self.backend = backend
        self.backend_name = backend.name
        if self.threads is not None and hasattr(backend, "plan_threads"):
            backend.plan_threads = self.threads.max_threads   # the governor's changes change no sum's order
        self.batch_invariant = cfg.batch_invariant
        if cfg.batch_invariant:
            if backend.name != "cpu" or self.device.type != "cpu":
                raise ValueError(f"batch_invariant needs the compiled CPU attention kernel, but this engine runs "
                                 f"{backend.name} attention on {self.device.type}")
            backend.split_k = False
            backend.fresh_prefill = False   # every chunk on the paged kernel: one path whatever the batch
        # oneDNN builds a kernel per matmul shape on first use (5-25 ms each): padding the
        # step's token count to a few buckets bounds how many a run ever builds, so a cold
        # process runs as fast as a warm one. The cpu backend leaves padding rows alone.
        # Batch-invariant matmuls build nothing per shape (or run one tile shape): no padding.
        self.pad_steps = backend.name == "cpu" and not cfg.batch_invariant
        if backend.name == "triton" and self.device.type == "cpu":
            logger.warning("the Triton backend on CPU runs under Triton's interpreter: correct but very slow "
                           "(meant for tests); use --attention-backend torch")
        kernels = _cpu_kernels() if self.device.type == "cpu" else None
        if model_cfg.moe is not None:
            self._check_moe(cfg, model_cfg)
        if tp.distributed and tp.size > 1 and self.device.type == "cpu":
            from ..distributed import shm

            # The ranks of one machine add up through shared memory (PAGEDLLM_TP_SHM=0: gloo).
            wanted = tp.local_size == tp.size and os.environ.get("PAGEDLLM_TP_SHM", "1") != "0"
            via = "shared memory" if shm.attach(tp, kernels, wanted) else "gloo"
            if tp.is_driver:
                logger.info("tensor parallel: all-reduce through %s", via)
        if cfg.enable_lora:   # before the weights are read: a refusal costs nothing
            self._check_lora(cfg, tp, kernels)
        model = build_model(model_dir, model_cfg, backend, kernels, tp, self.device, self.dtype, max_model_len)
        self.rope_rows = rope_rows(model_cfg, max_model_len)
        self.model_cfg, self.model_dir = model_cfg, model_dir
        if cfg.quantization is not None:
            if self.device.type != "cpu":
                raise ValueError(f"quantization {cfg.quantization!r} runs on the CPU only, not on {self.device}")
            gguf = None
            if cfg.quantization == "gguf":
                from ..loader.gguf_quant import model_gguf_blocks
                gguf = model_gguf_blocks(cfg.model, model_cfg)
            maxima = self.calibrate(model, model_dir, cfg.block_size) if cfg.quantization == "w8a8" else None
            done = model.quantize(cfg.quantization, gguf, maxima)
            if tp.is_driver:
                logger.info("quantized: %s", done)
        if cfg.enable_lora:
            name_lora_layers(model)
        # After quantizing: w8a8's matmuls are batch-invariant as they are, what stays float is packed.
        invariant = model.make_batch_invariant() if cfg.batch_invariant else None
        packed = model.prepack()
        self.model = model
        self._greedy_head = model.greedy_head()   # greedy rows' tokens from the head's argmax kernel (settled now)
        log = logger.info if tp.is_driver else logger.debug
        log("model loaded in %.1f s (%s, %s, %s attention%s%s)", time.perf_counter() - t0, self.dtype, self.device,
            backend.name, f"; batch-invariant: {invariant}, no split-K attention" if invariant else "",
            f"; matmuls {describe_paths(model)}" if packed else "")
        measured = chooser().take_measured()
        if measured:
            log("kernel choice: %d matmul shapes timed on this CPU in %.1f s, %s (`pagedllm env` prints them)",
                len(measured), sum(v.measure_s for v in measured),
                "cached for later starts" if all(v.source == "measured" for v in measured)
                else "not cached: other processes were using the CPUs")
        spec = cfg.speculative_config
        self.draft = None
        if spec is not None and spec.method == "draft_model":
            from .draft import DraftRunner
            if tp.size > 1:
                raise ValueError("a draft model with tensor_parallel_size > 1 is not supported")
            self.draft = DraftRunner(resolve_model_dir(spec.model), backend, kernels, self.device, self.dtype,
                                     max_model_len)
        self.kv_layout = self._kv_layout(cfg, model_cfg)
        # Each layer's group: its block tables and slots (one metadata per group per step).
        self.layer_groups = [self.kv_layout.place(i)[0] for i in range(model_cfg.num_layers)]
        self.kv_cache = KVCache(model_cfg, cfg, self.dtype, self.device, backend,
                                profile=lambda: self._profile_activations(cfg, model_cfg), tp=tp,
                                extra_bytes_per_token=self.draft.bytes_per_token if self.draft else 0,
                                layout=self.kv_layout)
        if self.draft is not None:  # the draft's pool mirrors the target's blocks: one block table for both
            self.draft.allocate(self.kv_cache.num_blocks, cfg.block_size)
        # LoRA adapters: read from disk into host memory (max_cpu_loras), paged into the pool's
        # blocks (lora.paged), read from there by the kernel.
        self.loras: AdapterCache[LoRAAdapter] | None = None
        self.paged: dict[int, PagedAdapter] = {}
        self._adapter_events: list[tuple] = []   # rank 0, tensor parallel: not yet sent to the others
        if cfg.enable_lora:
            self.max_lora_rank = cfg.max_lora_rank
            self.slabs = AdapterSlabs(self.kv_cache.pools, self.kv_layout, model_cfg, self.dtype)
            self.loras = AdapterCache(self._read_adapter, cfg.max_cpu_loras or cfg.max_loras)
        # Drafts for the next step, proposed after sampling (rank 0 only: it samples).
        self.proposer = make_proposer(spec, self.draft) if spec is not None and tp.is_driver else None
        self.max_model_len = max_model_len
        self.tier_io: TierIO | None = None   # the second tier, when the engine opens one
        self.graphs = None
        # Decode graphs would capture one rank's collectives: under TP every step runs eagerly.
        if self.device.type == "cuda" and backend.supports_decode_graphs and not cfg.enforce_eager \
                and not cfg.enable_lora \
                and not tp.distributed and len(self.kv_layout.groups) == 1:
            from .cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, backend, self.kv_cache.layers, cfg.max_num_seqs,
                                       self.max_model_len, cfg.block_size, self.device)
            self.graphs.capture()

    @staticmethod
    def _check_moe(cfg: EngineConfig, mc: ModelConfig) -> None:
        """What a mixture of experts does not run yet: its experts run float (bf16, fp32) or on weight-only
        blocks (int8, int4, a GGUF file's), not batch-invariant, without adapters."""
        why = "batch_invariant" if cfg.batch_invariant else "enable_lora" if cfg.enable_lora else None
        if why:
            raise ValueError(f"{why} is not supported with a mixture of experts ({mc.model_type}) yet: its experts "
                             "run as float matmuls (bf16 or fp32), on weight-only blocks (quantization int8, int4 or "
                             "gguf) or W8A8, not batch-invariant, without adapters")

    def _check_lora(self, cfg: EngineConfig, tp: TPGroup, kernels) -> None:
        """Adapters are read from the pool's pages by the compiled CPU kernel, or by Triton's on a GPU
        (lora.triton_sgmv): what lacks one is refused."""
        if cfg.quantization == "w8a8":
            raise ValueError("enable_lora with quantization w8a8 is not supported: SmoothQuant folds scales into the "
                             "matmuls' inputs (and v's outputs), which an adapter trained on the model as published "
                             "does not know; weight-only int8, int4 and gguf run adapters")
        if self.device.type == "cpu":
            if kernels is None or self.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"enable_lora on the CPU runs adapters from the KV pool's pages in the compiled "
                                 f"kernel: it needs bf16 or float32 and the kernels built, not {self.dtype}"
                                 f"{'' if kernels is not None else ', no kernels'}")
        else:
            from ..attention import triton_available

            why = triton_available()
            if why is not None:
                raise ValueError(f"enable_lora on {self.device} runs adapters in Triton kernels: {why}")

    def _read_adapter(self, req: LoRARequest) -> LoRAAdapter:
        """An adapter read from disk and sized in pages (the loader's thread: never the engine loop's)."""
        adapter = load_adapter(req, self.model_cfg, self.max_lora_rank, self.dtype, (self.tp.rank, self.tp.size))
        adapter.num_pages = self.slabs.pages(adapter)
        if adapter.num_pages > self.kv_cache.num_blocks:
            raise ValueError(f"lora: {req.lora_name!r} takes {adapter.num_pages} KV pages and the pool has "
                             f"{self.kv_cache.num_blocks} blocks; raise kv_cache_memory")
        return adapter

    def _place_adapters(self, plan: StepPlan) -> None:
        """Write the adapters the step placed into their pages; forget those evicted. Under tensor
        parallelism the other ranks do the same with their slices, told with the next forward."""
        events = [("evict", a) for a in plan.adapter_evictions] + \
            [("load", a, pages, self.loras.entries[a][0]) for a, pages in plan.adapter_loads]
        self._apply_adapter_events(events)
        if self.tp.distributed:
            self._adapter_events += events

    def _apply_adapter_events(self, events: list[tuple]) -> None:
        for ev in events:
            if ev[0] == "evict":
                self.paged.pop(ev[1], None)
            else:
                _, a, pages, req = ev
                # rank 0's adapter was read before its request ran (at once from host memory);
                # another rank reads its slice now, the first time (kept as max_cpu_loras allows)
                self.paged[a] = self.slabs.place(self.loras.load_now(req), pages)

    def _kv_layout(self, cfg: EngineConfig, mc: ModelConfig) -> KVLayout:
        """The KV cache's layer groups (kv.groups): by attention type, so that windowed layers
        release their old blocks while full-attention ones keep theirs. What reads the pool
        with one block table per sequence gets one group, windowed only if every layer that
        reads it is: a draft model beside the target (same block ids), the disk tier (blocks
        under one key each), reserve-max (one reservation)."""
        windows = [mc.window(i) for i in range(mc.num_layers)]
        why = "a draft model shares the block table" if self.draft is not None else \
            "the KV tier keeps one block per key" if cfg.kv_offload is not None else \
            "reserve-max reserves one table" if cfg.allocation == "reserve-max" else None
        if why is None:
            return kv_layout(windows)
        one = merged(windows + ([self.draft.cfg.window(i) for i in range(self.draft.cfg.num_layers)]
                                if self.draft is not None else []))
        if any(windows) and not one.groups[0].window and self.tp.is_driver:
            logger.info("sliding-window layers mask their own windows, but a sequence keeps all its KV blocks (%s "
                        "and a full-attention layer reads every key)", why)
        return KVLayout.single(mc.num_layers, one.groups[0].window)

    def reset_sequences(self) -> None:
        """Forget what is kept per sequence (sampling RNGs, grammar matchers, drafts' state): a
        new engine over this runner numbers its sequences from 0 again."""
        self.generators.clear()
        self.grammars = None
        if self.proposer is not None:
            self.proposer.seqs.clear()

    # -- what the engine reads of the runner -----------------------------------
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

    def attach_tier(self, cfg: EngineConfig, model_dir: Path) -> BlockStore:
        """Open the second tier for this runner's pools (--kv-offload-dir on disk, or a shared
        store at --kv-offload-url): it keeps blocks of this engine's fingerprint; the runner
        copies bytes in and out of it."""
        if self.tp.size > 1:
            raise ValueError(f"{cfg.kv_offload_knob} with tensor_parallel_size > 1 is not supported: each rank "
                             "holds a slice of every block")
        pools = [t for pair in self.kv_cache.pools for t in pair]
        if self.draft is not None:
            pools += [t for layer in self.draft.layers for t in layer]
        blocks = BlockBytes(pools)
        spec = cfg.speculative_config
        draft_dir = resolve_model_dir(spec.model) if self.draft is not None else None
        fp = kv_fingerprint(model_dir, draft_dir, self.dtype, self.kv_cache.kv_dtype.name, cfg.block_size,
                            self.backend_name, cfg.quantization, pools)
        if cfg.kv_offload_url is not None:
            from ..kv.redis_store import RedisStore

            store: BlockStore = RedisStore(cfg.kv_offload_url, fp, blocks.block_bytes)
        else:
            store = TierStore(cfg.kv_offload_dir, cfg.kv_offload_size, fp, blocks.block_bytes)
        self.tier_io = TierIO(store, blocks)
        return store

    def move_blocks(self, plan: StepPlan) -> None:
        """A step that runs no forward still carries out its tier IO (a load for a request
        that then waited, a write that the disk's catching up released), and places its adapters."""
        self._place_adapters(plan)
        if self.tier_io is not None:
            self.tier_io.before_forward(plan.saves, plan.loads)
            self.tier_io.after_forward(plan.writes)

    def write_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Write these (block, key) to the tier now and wait for them (a clean shutdown)."""
        if self.tier_io is not None:
            self.tier_io.after_forward(pairs)
            self.tier_io.store.flush()

    def describe(self) -> str:
        """dtype, device, attention backend, threads and batch-invariant mode, for reports."""
        threads = f", {torch.get_num_threads()} threads" if self.device.type == "cpu" else ""
        mode = ", batch-invariant" if self.batch_invariant else ""
        if self.model.ops.quant is not None:
            mode += f", {self.model.ops.quant} weights ({self.model.quant_summary})"
        tp = f", tensor parallel {self.tp.size} ({'shm' if self.tp.shm is not None else 'gloo'})" \
            if self.tp.size > 1 else ""
        return f"{self.dtype}, {self.device}, {self.backend_name} attention{threads}{mode}{tp}"

    @torch.inference_mode()
    def prefill_logits(self, model, ids: list[int], bs: int) -> torch.Tensor:
        """Logits of one prefill of `ids` through `model`, on KV pools of its own (the
        calibration pass; tests compare a model before and after it is changed)."""
        t = len(ids)
        tmp, meta = self._scratch_prefill(self.model_cfg, t, bs)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        return model.compute_logits(model(tokens, torch.arange(t, device=self.device), tmp, meta))

    def _scratch_prefill(self, mc: ModelConfig, t: int, bs: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
        """KV pools of their own for one sequence of t tokens, and its prefill's metadata:
        a forward outside the engine's pool (the profile run, the calibration pass)."""
        nblk = cdiv(t, bs)
        k_shape, v_shape = self.backend.cache_shapes(nblk, bs, mc.num_kv_heads, mc.head_dim, self.dtype)
        pool = self.backend.pool_dtype(self.dtype)
        tmp = [(torch.zeros(k_shape, dtype=pool, device=self.device), torch.zeros(v_shape, dtype=pool, device=self.device))
               for _ in range(mc.num_layers)]
        return tmp, self.backend.build_metadata(StepLayout(list(range(t)), [list(range(nblk))], [t], [0, t], 0), self.device)

    def calibrate(self, model, model_dir: Path, bs: int) -> dict[str, torch.Tensor]:
        """Each matmul's input maxima per channel over one prefill of the calibration text
        (SmoothQuant's statistics, models/smoothing.py), through the float model."""
        from ..loader import load_tokenizer
        from ..models.smoothing import CALIBRATION_TEXT, input_maxima

        ids = load_tokenizer(model_dir).encode(CALIBRATION_TEXT)[:self.rope_rows]
        return input_maxima(model, lambda: self.prefill_logits(model, ids, bs))

    @torch.inference_mode()
    def _profile_activations(self, cfg: EngineConfig, mc: ModelConfig) -> int:
        """Peak bytes a forward of the largest step takes beyond the weights (vLLM's
        profile run): max_num_batched_tokens in one prefill, then the logits of
        max_num_seqs rows. What is left of the budget goes to KV blocks."""
        t = cfg.max_num_batched_tokens
        tmp, meta = self._scratch_prefill(mc, t, cfg.block_size)
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        hidden = self.model(torch.zeros(t, dtype=torch.long, device=dev),
                            torch.arange(t, device=dev) % self.rope_rows, tmp, meta)
        self.model.compute_logits(hidden[:min(t, cfg.max_num_seqs)]).float()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del tmp, hidden
        torch.cuda.empty_cache()
        logger.info("profile run: %d tokens need %.2f GiB of activations", t, peak / 2**30)
        return peak

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the step: sample, verify drafts, score prompt tokens."""
        if self.threads is not None:
            self.threads.tick()
        for seq_id in plan.finished_seq_ids:
            self.generators.pop(seq_id, None)
            if self.grammars is not None:
                self.grammars.drop(seq_id)
        if self.tier_io is not None:  # before any block is written
            self.tier_io.before_forward(plan.saves, plan.loads)
        self._place_adapters(plan)
        if self.draft is not None:  # its pool mirrors the target's blocks: the same copies
            self.draft.copy_blocks(plan.copies)
        step, sample_rows, checks, scored, embeds = self._inputs(plan)
        if self.tp.distributed:
            step.adapter_events, self._adapter_events = self._adapter_events, []
            self.tp.broadcast(step)
        logits, scores, greedy = self._forward(step, self._argmax_rows(sample_rows, checks, embeds))
        if self.tier_io is not None:  # their tokens' KV is written now
            self.tier_io.after_forward(plan.writes)
        out = StepResult(prompt_logprobs=self._split_scores(scores, scored))
        if greedy:
            sample_rows = self._take_greedy(sample_rows, greedy, out)
        if logits is not None:
            self._pick(logits, sample_rows, checks, embeds, out)
        if self.proposer is not None and (logits is not None or greedy):
            out.drafts = self.proposer.propose(plan, out)
        return out

    def _pick(self, logits: torch.Tensor, sample_rows: list, checks: list[Verify], embeds: list[tuple[int, int]],
              out: StepResult) -> None:
        """The step's tokens from its logits rows: grammars masked, drafts verified, embeddings
        kept, the rest sampled."""
        constrained = self._constrained(sample_rows, checks)
        if constrained:
            refused = self._grammars(logits).mask(logits, constrained)
            if refused:  # those sequences fail alone: they sample nothing
                sample_rows = [(i, [t for t in ts if t.seq_id not in refused]) for i, ts in sample_rows]
                sample_rows = [(i, ts) for i, ts in sample_rows if ts]
                checks = [c for c in checks if c.target.seq_id not in refused]
            out.errors.update(refused)
        if checks:
            out.accepted, out.tokens, errors = verify(logits, checks, self.eos_token_ids, self.generators)
            out.errors.update(errors)
        if embeds:
            self._embeddings(embeds, out)
        if sample_rows:
            rows = logits if not checks else logits[torch.tensor([i for i, _ in sample_rows], device=logits.device)]
            tokens, out.logprobs, errors = sample(rows, [t for _, t in sample_rows], self.model.ops.k,
                                                  self.eos_token_ids, self.generators)
            out.tokens.update(tokens)
            out.errors.update(errors)
        if constrained:
            self._advance_grammars(constrained, out)

    def _argmax_rows(self, sample_rows: list, checks: list[Verify], embeds: list[tuple[int, int]]) -> list[int]:
        """The sampled rows whose token is their logits' argmax and whose logits nobody else
        reads (greedy; no logprobs, penalties, grammar, beam or embedding): the head's kernel
        can give their tokens without writing their logits (Ops.argmax). A step that verifies
        drafts keeps every row's logits."""
        if checks or not self._greedy_head:
            return []
        skip = {i for i, _ in embeds}
        return [i for i, ts in sample_rows if i not in skip and all(map(_argmax_only, ts))]

    @staticmethod
    def _take_greedy(sample_rows: list, greedy: dict[int, int], out: StepResult) -> list:
        """The tokens of the rows the head's argmax decided (by their logits row); the other rows,
        renumbered as the rows of the logits that came without them."""
        rest, taken = [], 0
        for i, ts in sample_rows:   # in the order of their rows, as the logits
            if i in greedy:
                out.tokens.update((t.seq_id, greedy[i]) for t in ts)
                taken += 1
            else:
                rest.append((i - taken, ts))
        return rest

    def _embeddings(self, embeds: list[tuple[int, int]], out: StepResult) -> None:
        """The prompt's last hidden state of each (logits row, seq id) whose request asked for
        its embedding (its one row samples after the prompt's last token: a pooling request's
        only generated token, which nobody reads)."""
        for i, seq_id in embeds:
            out.embeddings[seq_id] = array("f", self._sampled_hidden[i].float().cpu().numpy().tobytes())

    @staticmethod
    def _constrained(sample_rows: list, checks: list[Verify]) -> list[GrammarRow]:
        """The rows a grammar constrains: a row's first target speaks for the samples of n
        that fork off it (they all start from the same output, none)."""
        rows = [GrammarRow(i, ts[0], []) for i, ts in sample_rows
                if ts[0].grammar is not None and ts[0].grammar_from is not None]
        rows += [GrammarRow(c.row, c.target, c.draft) for c in checks
                 if c.target.grammar is not None and c.target.grammar_from is not None]
        return rows

    def _grammars(self, logits: torch.Tensor) -> GrammarMatchers:
        if self.grammars is None:
            self.grammars = GrammarMatchers(logits.shape[-1], self.model.ops.k)
        return self.grammars

    def _advance_grammars(self, constrained: list[GrammarRow], out: StepResult) -> None:
        """Each matcher takes the tokens its sequence keeps (accepted drafts, the new token);
        the other samples of a row build theirs from their tokens next step."""
        for r in constrained:
            sid = r.target.seq_id
            if sid in out.tokens and sid not in out.errors:
                error = self.grammars.advance(r.target, out.accepted.get(sid, []) + [out.tokens[sid]])
                if error is not None:
                    out.errors[sid] = error
                    out.tokens.pop(sid)
                    out.accepted.pop(sid, None)

    @torch.inference_mode()
    def serve(self) -> None:
        """A tensor-parallel rank other than 0: run rank 0's steps until it sends None."""
        while (step := self.tp.broadcast(None)) is not None:
            if self.threads is not None:
                self.threads.tick()
            self._apply_adapter_events(step.adapter_events)
            self._forward(step)

    @staticmethod
    def _inputs(plan: StepPlan) -> tuple[StepInputs, list, list[Verify], list[tuple[int, int, int]],
                                         list[tuple[int, int]]]:
        """The step's inputs; the rows that sample, as (logits row, [targets]); the drafts
        to verify; (seq id, prompt tokens scored, top k) in the order of step.score_rows; and
        (logits row, seq id) of the rows whose prompt's embedding is asked (SamplingParams.embed)."""
        # Single-token queries first, shortest context first: they attend in padded
        # groups of similar length. Chunks with no keys before them last: the CPU backend may
        # run that tail of the step apart (attention/fresh_prefill.py).
        order = sorted(plan.chunks, key=lambda c: (c.num_tokens != 1, c.start == 0, c.start))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_starts: list[int] = [0]
        logit_rows: list[int] = []
        sample_rows: list = []
        checks: list[Verify] = []
        scores: tuple[list[int], list[int], list[int]] = ([], [], [])
        scored: list[tuple[int, int, int]] = []
        embeds: list[tuple[int, int]] = []
        more = len(order[0].groups) if order else 0   # layer groups 1..
        group_slots: list[list[int]] = [[] for _ in range(more)]
        group_tables: list[list[list[int]]] = [[] for _ in range(more)]
        lora_rows: dict[int, list[int]] = {}
        for c in order:
            base = len(ids)
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.end))
            slots.extend(c.slots)
            for g, (sl, bt) in enumerate(c.groups):
                group_slots[g].extend(sl)
                group_tables[g].append(bt)
            q_starts.append(len(ids))
            if c.lora_id:
                lora_rows.setdefault(c.lora_id, []).extend(range(base, len(ids)))
            if c.draft:  # a speculating decode: its last len(draft) + 1 rows verify
                checks.append(Verify(len(logit_rows), c.samples[0], c.draft))
                logit_rows.extend(range(len(ids) - len(c.draft) - 1, len(ids)))
            elif c.samples:
                if c.samples[0].params.embed:
                    embeds.append((len(logit_rows), c.samples[0].seq_id))
                sample_rows.append((len(logit_rows), c.samples))
                logit_rows.append(len(ids) - 1)
            if c.score_ids:
                first = base + c.score_start - c.start
                scores[0].extend(range(first, first + len(c.score_ids)))
                scores[1].extend(c.score_ids)
                scores[2].extend([c.score_top] * len(c.score_ids))
                scored.append((c.seq_id, len(c.score_ids), c.score_top))
        nd = sum(1 for c in order if c.num_tokens == 1)
        step = StepInputs(ids, positions, slots, [c.block_ids for c in order], [c.end for c in order], q_starts,
                          nd, logit_rows, plan.copies, *scores, group_slots, group_tables, lora_rows)
        return step, sample_rows, checks, scored, embeds

    def _forward(self, step: StepInputs, argmax_rows: list[int] = ()
                 ) -> tuple[torch.Tensor | None, list[torch.Tensor], dict[int, int]]:
        """The step's forward on this rank: logits of the rows that sample (the whole
        vocabulary on rank 0, None on the other ranks and when nothing samples), the scored
        prompt tokens' logprobs, and the tokens of `argmax_rows` (logits rows) where the head
        gave them without logits ({row: token}); the logits then leave those rows out."""
        self.kv_cache.copy_blocks(step.copies)
        ids, positions, slots = step.ids, step.positions, step.slots
        nd, n = step.num_decodes, len(step.seq_lens)
        if self.graphs is not None and nd == n and self.graphs.fits(nd):
            hidden = self.graphs.run(ids, positions, slots, step.tables, step.seq_lens)
        else:
            group_slots = step.group_slots
            if self.pad_steps:  # padding rows: token 0 at position 0, no slot, in no sequence
                pad = step_bucket(len(ids)) - len(ids)
                ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
                group_slots = [g + [-1] * pad for g in group_slots]
            dev = self.device
            metas = [self.backend.build_metadata(StepLayout(sl, tables, step.seq_lens, step.q_starts, nd), dev)
                     for sl, tables in zip([slots, *group_slots], [step.tables, *step.group_tables])]
            self.model.ops.lora = None if not step.lora_rows else \
                lora_step(step.lora_rows, self.paged, self.model.ops.k if dev.type == "cpu" else None,
                          self.slabs.geometry.width, self.slabs.views[0][0])
            try:
                hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                                    self.kv_cache.layers, metas[0],
                                    [metas[g] for g in self.layer_groups] if len(metas) > 1 else None)
            finally:
                self.model.ops.lora = None
        scores = self._score_prompt(hidden, step) if step.score_rows else []
        if not step.logit_rows:
            return None, scores, {}
        rows = hidden[torch.tensor(step.logit_rows, device=hidden.device)]
        self._sampled_hidden = rows   # the rows' hidden states, for the embeddings asked for (execute)
        greedy = {}
        if argmax_rows:
            picked = self.model.greedy_tokens(rows[torch.tensor(argmax_rows, device=rows.device)])
            if picked is not None:
                greedy = dict(zip(argmax_rows, picked.tolist()))
                rest = [i for i in range(len(step.logit_rows)) if i not in greedy]
                if not rest:
                    return None, scores, greedy
                rows = rows[torch.tensor(rest, device=rows.device)]
        return self.tp.gather_vocab(self.model.compute_logits(rows)), scores, greedy

    def _score_prompt(self, hidden: torch.Tensor, step: StepInputs) -> list[torch.Tensor]:
        """Each scored row's next prompt token: [its logprob, its rank, the top-k ids, their
        logprobs] for all rows (k: the step's largest), on the CPU (rank 0; the other ranks
        take part in the gathers and return []). Rows go SCORE_ROWS at a time: a whole
        prompt's float32 logits would take rows x vocab x 4 bytes at once."""
        parts: list[list[torch.Tensor]] = []
        k = max(step.score_top)
        for i in range(0, len(step.score_rows), SCORE_ROWS):
            rows = torch.tensor(step.score_rows[i:i + SCORE_ROWS], device=hidden.device)
            logits = self.tp.gather_vocab(self.model.compute_logits(hidden[rows]))
            if logits is None:
                continue
            want = torch.tensor(step.score_ids[i:i + SCORE_ROWS], device=logits.device)
            kernels = self.model.ops.k
            if kernels is not None and logits.device.type == "cpu":  # two passes a row, in place
                parts.append(list(kernels.score_rows(logits.contiguous(), want, k)))
                continue
            # logprob = logit - logsumexp: no [rows, vocab] log_softmax is written, only read.
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            raw = logits.gather(1, want[:, None])
            ranks = (logits > raw).sum(dim=-1, dtype=torch.int32) + 1  # int32: half the int64 sum's time
            top = torch.topk(logits, k, dim=-1)
            parts.append([(raw - lse)[:, 0], ranks, top.indices, top.values - lse])
        return [torch.cat(p).cpu() for p in zip(*parts)] if parts else []

    @staticmethod
    def _split_scores(scores: list[torch.Tensor], scored: list[tuple[int, int, int]]) -> dict[int, PromptScores]:
        """The step's scored rows as each sequence's PromptScores, at its own k."""
        if not scores:
            return {}
        chosen, ranks, ids, lps = scores
        out, i = {}, 0
        for seq_id, n, k in scored:
            out[seq_id] = PromptScores(k, array("f", chosen[i:i + n].numpy().tobytes()),
                                       array("i", ranks[i:i + n].to(torch.int32).numpy().tobytes()),
                                       array("i", ids[i:i + n, :k].to(torch.int32).contiguous().numpy().tobytes()),
                                       array("f", lps[i:i + n, :k].contiguous().numpy().tobytes()))
            i += n
        return out
