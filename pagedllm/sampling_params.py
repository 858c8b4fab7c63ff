"""Per-request sampling settings, validated at construction (vLLM's names)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Below this temperature sampling is greedy, as in vLLM: dividing logits by 1e-40 gives
# inf - inf = nan, and no distribution is that sharp in any float format we compute in.
SAMPLING_EPS = 1e-5
# The nucleus always keeps the top token, so any top_p below this floor means the same
# thing, and a floor keeps top_p * sum away from underflow.
TOP_P_FLOOR = 1e-6


class RequestOutputKind(enum.Enum):
    """What a request's outputs carry while it runs (vLLM's): everything so far, only what
    is new since the last output (a stream writes it as it comes), or one output at the end."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The constraint kinds of StructuredOutputsParams, in the order a message lists them.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the output must match exactly one of a JSON schema (a
    dict or its JSON text), a regex (the whole output), one of `choice`'s strings, an
    EBNF/GBNF grammar (xgrammar's dialect, root rule `root`), or any JSON object.
    Checked for shape here; the schema, regex or grammar itself when compiled."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's: JSON without free whitespace between tokens (", " and ": " only).
    disable_any_whitespace: bool = False
    # A reasoning model's end of thinking (the token ids of "</think>"): the output is free
    # until they appear, and what follows them must match (the server's --reasoning-parser sets it).
    reasoning_end: list[int] | None = None

    def __post_init__(self) -> None:
        asked = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(asked) != 1:
            raise ValueError("structured_outputs must ask for exactly one of json, regex, choice, grammar or "
                             f"json_object, got {', '.join(asked) if asked else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
        if self.choice is not None:
            self.choice = list(self.choice)
        if self.reasoning_end is not None and (not self.reasoning_end or not all(
                _int(t) and t >= 0 for t in self.reasoning_end)):
            raise ValueError("structured_outputs.reasoning_end must be a non-empty list of token ids")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None    # draw this many samples, return the n of highest cumulative logprob
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
    # None: off; k >= 0: each prompt token's logprob given the tokens before it, and the top k
    # there (perplexity, log-likelihood scoring). Such a prompt skips the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True   # leave special tokens (EOS, chat markers) out of the text
    min_p: float = 0.0            # drop tokens less likely than min_p x the top token's probability
    min_tokens: int = 0           # EOS and stop_token_ids cannot end the output before this many tokens
    presence_penalty: float = 0.0     # subtracted once from a token already in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # > 1 discourages tokens of the prompt or the output (HF's rule)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrained decoding: every output token keeps the output a prefix of a match.
    structured_outputs: StructuredOutputsParams | None = None
    # Pooling: the prompt's embedding in RequestOutput.embedding, the decoder's last hidden state
    # (after its final norm) at the prompt's last token. It rides on the prefill of a one-token
    # generation, so a cached prefix is not computed again (LLM.embed and /v1/embeddings set it).
    embed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()
        if self.temperature < SAMPLING_EPS:
            self.temperature, self.top_p, self.top_k = 0.0, 1.0, 0
        self.top_p = max(float(self.top_p), TOP_P_FLOOR)
        if self.top_k >= 1 << 31:  # larger than any vocabulary: off (and it must fit an int64)
            self.top_k = 0

    def _check(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        if not _int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.embed is not False and (self.embed is not True or self.n != 1 or self.best_of not in (None, 1)):
            raise ValueError(f"embed must be a boolean, with n 1 (one embedding a prompt), got embed={self.embed!r} "
                             f"n={self.n!r}")
        if not _number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", "a finite number >= 0")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (or -1 for off)")
        if self.max_tokens is not None and (not _int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        # Their upper bound is the engine's max_logprobs (RequestRules.check_lengths).
        if self.logprobs is not None and (not _int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0")
        if self.prompt_logprobs is not None and (not _int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "an integer >= 0")
        if self.seed is not None and (not _int(self.seed) or not -(1 << 63) <= self.seed < 1 << 64):
            raise bad("seed", "a 64-bit integer")
        if self.best_of is not None and (not _int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not _int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "in [-2, 2]")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "a finite number > 0")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or any(not _int(t) or not 0 <= t < 1 << 63 for t in self.logit_bias)
                or any(not _number(b) or not math.isfinite(b) for b in self.logit_bias.values())):
            raise bad("logit_bias", "a dict of token id >= 0 to a finite number")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "a boolean")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not _int(t) or not 0 <= t < 1 << 63 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences to draw: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def ranks_samples(self) -> bool:
        """Whether samples are ranked by cumulative logprob (best_of > n), so the sampler
        must give each chosen token's logprob even when logprobs are not asked for."""
        return self.num_samples > self.n

    @property
    def penalized(self) -> bool:
        """Whether the logits need a pass before sampling (the others skip it, at no cost)."""
        return bool(self.min_p > 0 or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


@dataclass
class BeamSearchParams:
    """vLLM's beam-search settings, with HF's length_penalty and early_stopping meanings:
    a finished hypothesis scores sum(logprobs) / generated_len ** length_penalty, and the
    search ends when every kept hypothesis beats what a live beam could still reach
    (False), as soon as k hypotheses are kept (True), or only at max_tokens ("never")."""
    beam_width: int
    max_tokens: int | None     # None: up to max_model_len
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not _int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (not _int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or self.temperature != 0:
            raise ValueError(f"beam search is deterministic here: temperature must be 0, got {self.temperature!r}")
        if not _number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def n(self) -> int:
        """Outputs per prompt: the kept beams."""
        return self.beam_width

    def sampling_params(self) -> SamplingParams:
        """What the engine's common paths read (greedy rows, max_tokens, EOS handling)."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
