"""What makes a request acceptable: its prompt, its sampling or beam settings, and whether
it can ever fit the KV pool. Plain rules over a tokenizer, limits and a pool's shape: the
engine asks them before queueing; with data parallelism the server asks them in its own
process, of the smallest replica's pool."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from ..kv import PoolShape
from ..sampling_params import BeamSearchParams, SamplingParams


def chars_per_token(tokenizer) -> int:
    """No token spans more characters than the longest vocabulary entry (2x for
    normalizers that merge characters): a bound on a prompt's length before encoding."""
    return 2 * max(map(len, tokenizer.get_vocab()), default=1)


@dataclass
class RequestRules:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    kv: PoolShape          # its policy, pool size and can_ever_fit
    max_logprobs: int = 20  # the most top-k a request may ask per token (--max-logprobs)
    chars_per_token: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.chars_per_token:
            self.chars_per_token = chars_per_token(self.tokenizer)

    def validate(self, prompt: str | Seq[int], params: SamplingParams | BeamSearchParams,
                 add_special_tokens: bool = True) -> list[int]:
        """Token ids of a request the engine would accept; ValueError naming what is wrong.
        Reads no mutable state, so any thread may call it."""
        params, beam = self.split_params(params)
        _, ids = self.tokenize(prompt, add_special_tokens)
        self.check_lengths(len(ids), params, beam.beam_width if beam else 1)
        return ids

    def split_params(self, params) -> tuple[SamplingParams, BeamSearchParams | None]:
        """(what the common paths read, the beam settings of a beam-search request or None)."""
        if isinstance(params, SamplingParams):
            return params, None
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"sampling params must be a SamplingParams or BeamSearchParams, "
                             f"got {type(params).__name__}")
        beam = params
        if beam.beam_width > self.max_num_seqs:
            raise ValueError(f"beam_width {beam.beam_width} exceeds max_num_seqs ({self.max_num_seqs}): "
                             "the beams of a request run together")
        if self.kv.policy != "paged":
            raise ValueError("beam search shares blocks between beams: it needs allocation 'paged', "
                             f"not {self.kv.policy!r}")
        return beam.sampling_params(), beam

    def tokenize(self, prompt: str | Seq[int], add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if len(prompt) > self.chars_per_token * self.max_model_len:  # too long: spare the encoding
                raise ValueError(f"prompt is {len(prompt)} characters, so at least "
                                 f"{len(prompt) // self.chars_per_token} tokens; "
                                 f"it must be < max_model_len ({self.max_model_len}) tokens")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            if not ids:
                raise ValueError(f"prompt {prompt[:40]!r} encodes to no tokens")
            return prompt, ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        self.check_prompt_len(len(ids))  # before the per-id check: a huge list is refused at once
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    def check_prompt_len(self, prompt_len: int) -> None:
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt is {prompt_len} tokens; it must be < max_model_len ({self.max_model_len})")

    def check_lengths(self, prompt_len: int, params: SamplingParams, width: int = 1) -> int:
        """max_tokens after checking the request can ever run; `width` beams may each need
        their own blocks after a preemption by recompute (no sharing left then)."""
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name}: {k} is more than this server returns per token "
                                 f"(max_logprobs {self.max_logprobs})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        self.check_prompt_len(prompt_len)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                             f"{prompt_len + max_tokens} exceeds max_model_len ({self.max_model_len})")
        if not self.kv.can_ever_fit(prompt_len + max_tokens, width):
            beams = f" for each of {width} beams" if width > 1 else ""
            raise ValueError(f"prompt + max_tokens = {prompt_len + max_tokens} tokens{beams} needs more KV blocks "
                             f"than the whole pool ({self.kv.num_blocks} blocks of {self.kv.block_size})")
        return max_tokens


def check_draft_tokenizer(tokenizer, draft_model: str) -> None:
    """A draft model must speak the target's tokens: same vocabulary, same ids."""
    from ..loader import load_tokenizer, resolve_model_dir

    draft = load_tokenizer(resolve_model_dir(draft_model))
    ours, theirs = tokenizer.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"speculative_config: the draft model {draft_model!r} has another tokenizer than the "
                         f"target ({len(theirs)} tokens vs {len(ours)}; e.g. {differ}): a draft must use the "
                         "target's token ids")
