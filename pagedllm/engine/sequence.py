"""Requests and their sequences (one per sample of n)."""
from __future__ import annotations

import enum
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplingParams
from ..kv.hashing import BlockHashes
from ..lora.request import LoRARequest
from ..plan import PromptScores, PromptThenOutput
from .beam import BeamGroup


class SeqStatus(enum.Enum):
    PENDING = "pending"      # a sample of n > 1 waiting to fork off its parent
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence(PromptThenOutput):
    seq_id: int
    request: "Request"
    index: int                    # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Prompt logprobs from a prefix hit: positions below this hold cached KV, but rows from
    # num_computed_tokens up to it are computed again (writing nothing) to score tokens
    # whose logprobs the cache does not keep. 0 otherwise.
    reread_until: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    hashes: BlockHashes | None = None  # its block keys for the prefix cache (the scheduler sets them)
    logprobs: list = field(default_factory=list)  # {token id: Logprob} per output token, if asked
    cumulative_logprob: float = 0.0               # of the chosen tokens, when logprobs are asked
    # Speculative decoding: the drafts the runtime proposed after the last step, and this
    # step's draft tokens (in lookahead slots, not in token_ids until verified).
    spec_tokens: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    # Structured outputs after a reasoning model's thinking: the output position its grammar
    # starts at once the end marker is seen, and how far the output was searched for it.
    _grammar_from: int | None = None
    _searched: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def grammar_from(self) -> int | None:
        """The output position this sequence's grammar starts at: 0, or after the first
        structured_outputs.reasoning_end marker in its output (None while there is none).
        Each token is searched once however long the thinking runs; tokens dropped since (a
        stop string's tail) are searched again."""
        so = self.params.structured_outputs
        end = so.reasoning_end if so is not None else None
        if not end:
            return 0
        p, n, k = self.num_prompt_tokens, len(self.token_ids) - self.num_prompt_tokens, len(end)
        if self._grammar_from is not None and self._grammar_from <= n:
            return self._grammar_from
        self._grammar_from, start = None, max(0, min(self._searched, n) - k + 1)
        ids = self.token_ids
        for i in range(start, n - k + 1):   # the new tokens only, read in place: no copy a step
            if ids[p + i:p + i + k] == end:
                self._grammar_from = i + k
                break
        self._searched = n
        return self._grammar_from

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    cache_salt: str | None = None
    arrival_time: float = 0.0
    scheduled_time: float | None = None  # first admitted to the running batch (queue time ends here)
    oldest_since: float | None = None    # LPM admission: since when it is the oldest request waiting
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0    # prompt tokens served from the prefix cache at first admission
    owner: str | None = None      # the tenant that sent it (the visualizer shows others' text to nobody)
    priority: int = 0             # vLLM's: lower runs first under the priority queue policy
    error: str | None = None      # set when this request alone failed inside a step
    error_invalid: bool = False   # ... because of its own parameters (a client error, HTTP 400)
    seqs: list[Sequence] = field(default_factory=list)
    # Beam search: the search state, the live beams (best first) and each live beam's
    # candidates once its row is computed (the group advances when all have theirs).
    beam: BeamGroup | None = None
    beams: list[Sequence] = field(default_factory=list)
    candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: the prompt tokens scored so far, from token 1 on (token
    # 0 has none), at the k kept beside cached blocks (the output processor cuts to the
    # request's).
    prompt_scores: PromptScores | None = None
    embedding: array | None = None   # SamplingParams.embed: the prompt's last hidden state, once computed
    # Structured outputs: the grammar's compile (a Future of structured.compiler.Grammar)
    # and, once it is done, the grammar. The request waits in the queue until then.
    compiling: Any = None
    grammar: Any = None
    lora: LoRARequest | None = None   # its adapter (enable_lora; engine.adapters); None: the base model

    @property
    def lora_id(self) -> int:
        return self.lora.lora_int_id if self.lora is not None else 0

    @property
    def block_salt(self) -> str | None:
        """What its block hashes are salted with: its cache_salt and its adapter (the same tokens
        under two adapters have different KV; vLLM keys blocks by the adapter too)."""
        if self.lora is None:
            return self.cache_salt
        return self.lora.cache_key if self.cache_salt is None else f"{self.cache_salt}\x00{self.lora.cache_key}"

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def request_seed(engine_seed: int, request_id: str) -> int:
    """A request's default seed from a stable hash of (engine seed, request id): Python's
    hash() is salted per process, so `--seed` would not reproduce a run in a new one."""
    digest = hashlib.blake2b(f"{engine_seed}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
