"""What a server talks to (vLLM's EngineClient): one engine behind a thread
(AsyncLLMEngine) or several behind a data-parallel front (DataParallelEngine). The server
reads an EngineInfo, fixed once the engine is built, and the latest figures; it submits
requests and reads their streams. It never reaches into an engine."""
from __future__ import annotations

from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..outputs import RequestOutput
from ..sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from .validation import RequestRules

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..lora.request import LoRARequest
    from .engine import EngineStats, LLMEngine


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue-len: try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """No engine runs to serve the request (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """This request failed inside a step (the others of the batch went on)."""


class InvalidRequestError(RequestFailedError, ValueError):
    """This request failed inside a step because of its own parameters, which cannot all be
    met (HTTP 400): e.g. a grammar that min_tokens keeps from ending."""


def failure(out) -> RequestFailedError:
    """The error a client's stream raises for a RequestOutput that carries one."""
    cls = InvalidRequestError if out.error_invalid else RequestFailedError
    return cls(f"request failed: {out.error}")


@dataclass(frozen=True)
class EngineInfo:
    """The served engine as the server describes it (/v1/models, /model_info, metrics labels)."""
    model_name: str            # the engine's own name of its model
    model: str | None          # --model as given
    tokenizer: Any             # the server tokenizes, templates and detokenizes with it
    rules: RequestRules        # what a request must satisfy (validated in the server's process too)
    max_model_len: int
    block_size: int
    num_blocks: int            # the smallest replica's pool
    enable_prefix_caching: bool
    cfg: EngineConfig
    model_dir: Path            # the HF directories read (a GGUF's converted one)
    tokenizer_dir: Path
    model_type: str            # config.json's, e.g. "llama"

    @property
    def vocab_size(self) -> int:
        return self.rules.vocab_size

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.model_name, engine.cfg.model, engine.tokenizer, engine.rules, engine.max_model_len,
                   engine.kv.block_size, engine.kv.pool.num_blocks, engine.kv.enable_prefix_caching, engine.cfg,
                   engine.model_dir, engine.tokenizer_dir, engine.model_cfg.model_type)


class StepObserver(Protocol):
    """Told on the engine's side about every step and every request ended outside one (metrics)."""

    def on_step(self, outputs: list[RequestOutput], tokens: int, moved: list[str]) -> None: ...
    def on_finished(self, output: RequestOutput) -> None: ...


class EngineClient(Protocol):
    info: EngineInfo
    stats: EngineStats                 # the latest figures (counters; the slot figures may be None)
    observer: StepObserver | None

    @property
    def alive(self) -> bool: ...

    def validate(self, prompt: str | Seq[int], params: SamplingParams | BeamSearchParams,
                 add_special_tokens: bool = True) -> list[int]: ...

    def submit(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | BeamSearchParams,
               cache_salt: str | None = None, owner: str | None = None,
               priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]: ...

    async def check_structured(self, so: StructuredOutputsParams, tenant: str | None = None) -> None:
        """Compile a constrained request's grammar (cached) before it is submitted; ValueError
        naming what is wrong (the server's 400). Compiles off the event loop, the tenants'
        compiles taking turns."""

    async def get_stats(self) -> EngineStats:
        """The figures now, KV slot figures included (a /metrics scrape)."""

    def wake(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...
