"""What generate() returns (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's: one token's log-probability under the model's raw distribution, its rank in
    that distribution (1 = most likely), and its text alone."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per output token: the chosen token first, then the top k (vLLM's list[dict[int, Logprob]]).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None   # sum of the chosen tokens' logprobs, when logprobs asked


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
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob given the tokens before
    # it, then the top k (vLLM's shape); None for the first token, which nothing predicts.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With SamplingParams.embed: the prompt's embedding (the last token's final hidden state).
    embedding: list[float] | None = None
    # The error is the request's own (its parameters cannot all be met): a client error.
    error_invalid: bool = False


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's LLM.embed output: a prompt's embedding (`outputs.embedding`)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """vLLM's: one kept beam. `tokens` are the prompt's then the beam's (its EOS included)."""
    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None = None   # "stop" (EOS) or "length"
    stop_reason: int | None = None
    score: float = 0.0                 # cum_logprob / generated_len ** length_penalty (the ranking)


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's kept beams, best score first."""
    sequences: list[BeamSearchSequence]
