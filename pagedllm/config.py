"""EngineConfig: every knob of the engine. CLI flags map 1:1 onto its fields."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# The names every layer validates against, owned here once (the KV manager, the runner,
# the attention registry and the KV calculator read them; the CLI's choices come from them).
ALLOCATION_POLICIES = ("paged", "reserve-max")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ATTENTION_BACKENDS = ("cpu", "torch", "triton")
ROUTER_POLICIES = ("prefix", "round-robin", "least-loaded")
QUANTIZATIONS = ("int8",)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from 1048576, "512MiB", "4GiB" or "2.5GB"."""
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"kv_cache_memory: cannot read {value!r} as a size (e.g. 4GiB, 512MiB, 1073741824)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {value!r}")
    return n


def canonical_dtype(name: str) -> str:
    """float32, bfloat16 or float16 from any of their names (fp32, bf16, fp16 too)."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPE_BYTES) + sorted(DTYPE_ALIASES)}, got {name!r}")
    return name


def knob(default, help: str, **cli) -> Any:
    """A field with its command-line flag: the help text and any argparse options beyond
    name, default and type, so `pagedllm.cli` builds each flag from here and nowhere else."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    model: str | None = knob(None, "GGUF file or HF model dir (default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = knob(None, "GGUF file or HF dir to take the tokenizer from (default: the model's own)")
    block_size: int = knob(16, "tokens per KV block", type=int)
    enable_prefix_caching: bool = knob(True, "reuse cached KV blocks of identical prompt prefixes")
    allocation: str = knob("paged", "KV allocation policy: paged, or reserve-max (the traditional contiguous "
                           "reservation of max_model_len per request; no block sharing, so no prefix cache)",
                           choices=list(ALLOCATION_POLICIES))
    max_num_seqs: int = knob(256, "most sequences running at once", type=int)
    max_num_batched_tokens: int = knob(2048, "most tokens computed in one step", type=int)
    max_model_len: int | None = knob(None, "longest prompt + output (default: the model's "
                                     "max_position_embeddings)", type=int)
    kv_cache_memory: int | str | None = knob(
        None, "KV pool size, bytes or e.g. 2GiB (default: on CPU min(2 GiB, 25%% of free RAM); on CUDA from "
        "--gpu-memory-utilization)", type=parse_bytes)
    num_gpu_blocks_override: int | None = knob(None, "exact number of KV blocks, wins over the budgets "
                                               "(default: from the memory budget)", type=int)
    gpu_memory_utilization: float = knob(0.9, "fraction of GPU memory for weights, activations and KV (CUDA)",
                                         type=float)
    dtype: str = knob("auto", "weights and KV dtype; auto: bfloat16 on CUDA and on CPUs with native bf16, "
                      "else float32", choices=["auto", *DTYPE_BYTES])
    device: str = knob("auto", "auto, cpu, cuda or cuda:N (auto: cuda when available)")
    seed: int = knob(0, "engine seed: requests without their own seed sample from it", type=int)
    attention_backend: str = knob(
        "auto", "auto: Triton paged-attention kernels on CUDA, the compiled CPU kernel elsewhere "
        "(torch: the reference, gathers blocks for SDPA)", choices=["auto", *ATTENTION_BACKENDS])
    enforce_eager: bool = knob(False, "no CUDA graphs for decode steps")
    num_threads: int | None = knob(None, "CPU threads (default: OMP_NUM_THREADS, else one per physical core); "
                                   "fewer are used while other processes keep cores busy", type=int)
    batch_invariant: bool = knob(
        False, "a request's tokens the same alone, in any batch and after preemption (vLLM's "
        "VLLM_BATCH_INVARIANT): matmuls in a fixed reduction order (bf16 on AMX CPUs: our own kernel, measured "
        "1.1-1.2x oneDNN's throughput; otherwise oneDNN on 32-row tiles, 0.5-0.8x) and attention without "
        "split-K (a long context decoding alone uses fewer threads); CPU attention backend only")
    long_prefill_token_threshold: int = knob(
        0, "a prompt with more uncomputed tokens than this is prefilled this many tokens a step, leaving room "
        "for decodes and short prompts (0: a quarter of --max-num-batched-tokens)", type=int)
    max_num_partial_prefills: int = knob(1, "long prompts prefilled at once; shorter ones are admitted past "
                                         "those that wait", type=int)
    quantization: str | None = knob(
        None, "weight-only quantization of the linear layers (vLLM's flag): int8, one scale per output channel, "
        "activations in --dtype; CPU; for latency: one request decodes ~2x faster, batched throughput drops to "
        "~0.35x (torch's int8 kernel is matrix-vector)", choices=list(QUANTIZATIONS))
    tensor_parallel_size: int = knob(
        1, "split the model over this many ranks (heads, KV heads, MLP and vocab sharded; gloo on CPU, NCCL on "
        "CUDA); local worker processes are started for you, or run every rank under torchrun", type=int)
    data_parallel_size: int = knob(1, "engine replicas behind one server, each its own process and KV pool "
                                   "(pagedllm serve)", type=int)
    router_policy: str = knob("prefix", "how the server spreads requests over data-parallel replicas: prefix "
                              "(the replica likely to hold the prompt's first blocks; load overrides), "
                              "round-robin or least-loaded", choices=list(ROUTER_POLICIES))

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.allocation not in ALLOCATION_POLICIES:
            raise ValueError(f"allocation must be one of {ALLOCATION_POLICIES}, got {self.allocation!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype != "auto":
            self.dtype = canonical_dtype(self.dtype)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override!r}")
        if self.attention_backend not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be auto or one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be an integer >= 0 (0: automatic), "
                             f"got {self.long_prefill_token_threshold!r}")
        if not isinstance(self.max_num_partial_prefills, int) or self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be an integer >= 1, got {self.max_num_partial_prefills!r}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {self.router_policy!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization is not None and self.batch_invariant:
            raise ValueError("batch_invariant does not run quantized weights: drop one of them")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant with tensor_parallel_size > 1 is not supported: it is not checked "
                             "that the ranks' sums keep a request's tokens independent of its batch")
        if self.batch_invariant and (self.attention_backend not in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError("batch_invariant runs on the CPU attention backend only (attention_backend auto or cpu, "
                             f"device auto or cpu), got attention_backend={self.attention_backend!r}, "
                             f"device={self.device!r}")
