"""LoRA adapters served beside the base model: PEFT files read into low-rank pieces of our
matmuls (adapter.py), held and dropped by use (registry.py), and run over their rows of a mixed
step (batch.py). `LoRARequest` is vLLM's name for a request's adapter."""
from .request import LoRARequest

__all__ = ["LoRARequest"]
