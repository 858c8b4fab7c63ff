from .engine import EngineStats, LLMEngine
from .llm import LLM

__all__ = ["LLM", "EngineStats", "LLMEngine"]
