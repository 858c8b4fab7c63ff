"""EngineStats: an engine's figures at one moment (its read-only view of a step)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..kv import KVStats
from ..structured.compiler import GrammarStats
from .adapters import LoRAUse
from .speculative import SpecStats


@dataclass
class EngineStats:
    """Counters of the engine's life so far, for reports and metrics: the KV manager's
    own figures, and what only the engine knows (peaks, tokens, queues)."""
    kv: KVStats
    bytes_per_token: int     # M_KV: every layer's K and V of one token
    peak_used_blocks: int
    peak_waste: float        # eta at the step of peak usage
    preemptions: int
    num_running: int              # requests with a sequence running
    num_waiting: int              # requests with a sequence waiting (and none running)
    prompt_tokens: int            # prompt tokens of requests that started generating
    computed_prompt_tokens: int   # prefill tokens actually run (cache hits skip, recompute repeats)
    generation_tokens: int
    steps: int
    spec: SpecStats | None = None   # speculative decoding's counts, when it is on
    grammar: GrammarStats | None = None  # structured outputs' requests, compiles and cache hits
    kv_cache_dtype: str = "bfloat16"     # how the pool stores K/V (kv_dtype.py's names)
    # One pool block: B tokens of every layer, or of one layer group's layers (kv.groups).
    bytes_per_block: int = 0
    lora: LoRAUse | None = None   # the adapters in use (enable_lora; adapters.py)
    # The model's weights in memory (every rank's share) and what one token reads of them: a
    # mixture of experts holds all its experts and reads its top k (models/footprint.py).
    weights_bytes: int = 0
    active_weights_bytes: int = 0
    # A pool of latents (multi-head latent attention): what one token's K and V would take expanded
    # to full heads, as transformers caches them (0: the pool holds K and V themselves).
    expanded_bytes_per_token: int = 0

    @property
    def peak_kv_usage(self) -> float:
        return self.peak_used_blocks / self.kv.num_blocks

    @property
    def blocks_per_gib(self) -> int:
        """KV blocks a GiB of pool holds at this dtype and block size."""
        per_block = self.bytes_per_block or self.bytes_per_token * self.kv.block_size
        return 2**30 // per_block if per_block else 0

    def as_dict(self) -> dict:
        d = asdict(self)
        if self.grammar is not None:
            d["grammar"] = {n: getattr(self.grammar, n) for n in GrammarStats.__slots__}
        d["kv"] = self.kv.as_dict()
        d["peak_kv_usage"] = self.peak_kv_usage
        d["blocks_per_gib"] = self.blocks_per_gib
        if self.spec is not None:
            d["spec"].update(acceptance_rate=self.spec.acceptance_rate,
                             mean_accepted_length=self.spec.mean_accepted_length)
        return d
