"""PagedLLM: an LLM inference engine built on PagedAttention."""
from .config import EngineConfig
from .outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch; keep `import pagedllm.kv` light for the pure parts.
    if name in ("LLM", "LLMEngine"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "BeamSearchOutput", "BeamSearchSequence"]
