"""Per-request sampling settings, validated at construction (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: off
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None   # None: off; k >= 0: the chosen token's logprob and the top k

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", ">= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (or -1 for off)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
