"""The engine: scheduler, requests, LLMEngine and LLM. The scheduler and the request types
import no torch; the engine (which loads models) is imported on first use."""


def __getattr__(name: str):
    if name in ("LLMEngine", "EngineStats"):
        from . import engine
        return getattr(engine, name)
    if name == "LLM":
        from .llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "EngineStats", "LLMEngine"]
