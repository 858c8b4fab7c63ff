"""EngineConfig: every knob of the engine. CLI flags map 1:1 onto its fields."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .kv.manager import POLICIES

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


@dataclass
class EngineConfig:
    model: str | None = None            # GGUF file or HF model dir; None: SmolLM2-135M-Instruct
    tokenizer: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    allocation: str = "paged"           # or "reserve-max", the traditional contiguous reservation
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None    # None: the model's max_position_embeddings
    kv_cache_memory: int | str | None = None   # bytes or "4GiB"; None: from free RAM (CPU)
    num_gpu_blocks_override: int | None = None  # exact pool size, wins over the budgets
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16
    device: str = "auto"                # auto | cpu | cuda
    seed: int = 0
    attention_backend: str = "auto"     # auto (triton on CUDA, cpu on CPU) | cpu | torch | triton
    enforce_eager: bool = False         # True: no CUDA graphs for decode steps
    num_threads: int | None = None      # CPU threads; None: OMP_NUM_THREADS, else one per physical core
    batch_invariant: bool = False       # a request's tokens independent of the batch (CPU kernels; slower)
    long_prefill_token_threshold: int = 0   # chunk cap for long prompts; 0: max_num_batched_tokens / 4
    max_num_partial_prefills: int = 1       # long prompts in prefill at once

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.allocation not in POLICIES:
            raise ValueError(f"allocation must be one of {POLICIES}, got {self.allocation!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override!r}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, cpu, torch or triton, got {self.attention_backend!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be an integer >= 0 (0: automatic), "
                             f"got {self.long_prefill_token_threshold!r}")
        if not isinstance(self.max_num_partial_prefills, int) or self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be an integer >= 1, got {self.max_num_partial_prefills!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.batch_invariant and (self.attention_backend not in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError("batch_invariant runs on the CPU attention backend only (attention_backend auto or cpu, "
                             f"device auto or cpu), got attention_backend={self.attention_backend!r}, "
                             f"device={self.device!r}")
        if self.allocation == "reserve-max":
            self.enable_prefix_caching = False
