"""What the engine needs of whatever runs its steps: runtime.ModelRunner on real weights, or
a fake one in the engine core's tests. Plain data crosses: a StepPlan in, a StepResult out."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..config import EngineConfig
from ..kv import KVLayout
from ..kv.connector import BlockStore
from ..lora.registry import AdapterCache
from ..plan import StepPlan, StepResult


class Runner(Protocol):
    kv_layout: KVLayout          # the layer groups its pool is laid out in (kv.groups)
    eos_token_ids: frozenset[int]  # set by the engine: what min_tokens keeps from being sampled
    # LoRA adapters in host memory, read for the requests that name them (None: it serves none);
    # each adapter's num_pages: the KV pool pages it takes (the engine's LoRAHook places them).
    loras: AdapterCache | None

    @property
    def num_blocks(self) -> int: ...

    @property
    def bytes_per_token(self) -> int:
        """M_KV per token over every layer (and rank)."""

    @property
    def bytes_per_block(self) -> int:
        """One pool block (its layer slots, every rank)."""

    @property
    def kv_dtype_name(self) -> str: ...

    @property
    def weights(self):
        """The weights' bytes: .resident (held, every rank) and .active (what one token reads)."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run a step: copies, tier IO, the forward, sampling, verification, prompt scores."""

    def move_blocks(self, plan: StepPlan) -> None:
        """A step that runs no forward still carries out its tier IO."""

    def attach_tier(self, cfg: EngineConfig, model_dir: Path) -> BlockStore:
        """Open the KV tier's store (kv_offload_dir or kv_offload_url) for this runner's pools (it keeps the worker half)."""

    def write_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Write these (block, key) to the tier now and wait (a clean shutdown)."""

    def describe(self) -> str: ...

    def reset_sequences(self) -> None:
        """Forget what is kept per sequence: an engine starts numbering its sequences anew."""
