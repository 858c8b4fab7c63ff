"""A request's adapter, named as vLLM names it (`vllm.lora.request.LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """The PEFT adapter at `lora_path`, known to the engine as `lora_name` and `lora_int_id`
    (> 0: 0 is the base model). Requests naming the same id share the loaded adapter."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be an int > 0 (0 is the base model), got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_key(self) -> str:
        """What enters a prompt's block hashes: two adapters never share KV blocks."""
        return f"lora:{self.lora_int_id}"
