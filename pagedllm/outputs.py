"""What generate() returns (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float                       # of the chosen token, under the model's raw distribution
    top: list[tuple[int, float]] = field(default_factory=list)   # the k most likely (id, logprob)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)
    error: str | None = None           # why the request failed (finish_reason "error"), alone in its batch
