"""One step's work as the model runner needs it: the scheduler's decisions turned into
token ids, positions, slots, block tables, sampling rows and block copies.

Plain data below both the engine and the runner: the runner reads a StepPlan and never
sees the KV manager, a Sequence or the scheduler, so the arrows run one way
(engine -> plan <- runtime)."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from .outputs import Logprob
from .sampling_params import SamplingParams


class PromptThenOutput:
    """Tokens held as one list, prompt first: the output is what follows the prompt."""
    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True, eq=False)
class PromptScores:
    """Prompt logprobs of consecutive prompt tokens, compact: each token's logprob given
    the tokens before it, its rank, and the top k (ids and logprobs, k per token, best
    first). float32 as computed, so an entry kept beside a cached block reads back as the
    recomputed one would. Plain arrays: the KV manager keeps them without knowing them."""
    k: int
    logprobs: array = field(default_factory=lambda: array("f"))
    ranks: array = field(default_factory=lambda: array("i"))
    top_ids: array = field(default_factory=lambda: array("i"))   # [len * k], row-major
    top_logprobs: array = field(default_factory=lambda: array("f"))

    def __len__(self) -> int:
        return len(self.logprobs)

    @property
    def nbytes(self) -> int:
        """What it takes in memory (the KV manager's score store counts it against its cap)."""
        return sum(a.itemsize * len(a) for a in (self.logprobs, self.ranks, self.top_ids, self.top_logprobs))

    def slice(self, start: int, end: int) -> PromptScores:
        k = self.k
        return PromptScores(k, self.logprobs[start:end], self.ranks[start:end], self.top_ids[start * k:end * k],
                            self.top_logprobs[start * k:end * k])

    def extend(self, other: PromptScores) -> None:
        """Append `other`'s tokens, scored at the same k (a request's, and what the cache
        keeps, are all scored at the scheduler's one k)."""
        if other.k != self.k:
            raise ValueError(f"prompt scores of top {other.k} cannot extend scores of top {self.k}")
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)

    def entry(self, i: int, token_id: int, k: int) -> dict[int, Logprob]:
        """vLLM's shape for token i: {the prompt token: its Logprob, then the top k (k <= self.k)}."""
        out = {token_id: Logprob(self.logprobs[i], self.ranks[i])}
        base = i * self.k
        for rank in range(1, k + 1):
            out.setdefault(self.top_ids[base + rank - 1], Logprob(self.top_logprobs[base + rank - 1], rank))
        return out


@dataclass(slots=True, eq=False)
class SampleTarget(PromptThenOutput):
    """A sequence that samples its next token from a chunk's last row."""
    seq_id: int
    params: SamplingParams
    seed: int                 # seeds the runner's generator for this sequence, on first use
    token_ids: list[int]      # its tokens so far, prompt then output (penalties read them)
    num_prompt_tokens: int
    # A beam: no token is drawn; the runner returns this many best next tokens with their
    # log-probabilities, and the engine's beam search chooses.
    beam_candidates: int = 0
    # Speculative decoding: after sampling, propose up to this many draft tokens for the
    # sequence's next step (StepResult.drafts).
    num_spec: int = 0
    # Structured outputs: the request's compiled grammar (structured.compiler.Grammar), or None,
    # and the output position it starts at (None: not yet, a reasoning model still thinking).
    grammar: Any = None
    grammar_from: int | None = 0


@dataclass(slots=True, eq=False)
class ChunkPlan:
    """Tokens start..start+len(token_ids)-1 of one sequence, computed this step."""
    seq_id: int
    start: int
    token_ids: list[int]
    slots: list[int]          # where each token's K/V goes: block_ids[j // B] * B + j % B
    block_ids: list[int]      # the sequence's block table up to the chunk's last token
    # Who samples from the chunk's last row: nobody mid-prompt; the sequence itself, or
    # with n > 1 the parent and the samples that fork off it at the end of the prompt.
    samples: list[SampleTarget] = field(default_factory=list)
    # Speculative decoding: the chunk's last len(draft) tokens are draft tokens (in
    # lookahead slots); its last len(draft) + 1 rows verify them for the one sample target.
    draft: list[int] = field(default_factory=list)
    # The blocks after block_ids that hold the sequence's lookahead slots, where a draft
    # model writes the KV of its next proposal (after this step's sampling).
    lookahead_block_ids: list[int] = field(default_factory=list)
    # Prompt logprobs: the rows at positions score_start .. score_start + len(score_ids) - 1
    # each score the next prompt token (score_ids[i]), with the top score_top beside it.
    # A chunk may start before the sequence's prefix hit ends, to score tokens whose KV is
    # cached but whose logprobs are not: those rows have slot -1 (they write nothing).
    score_start: int = 0
    score_ids: list[int] = field(default_factory=list)
    score_top: int = 0
    # A model whose layers mix attention types (kv.groups): groups 1.. each have their own
    # blocks, so their own (slots, block_ids) of the chunk; slots and block_ids above are group 0's.
    groups: list[tuple[list[int], list[int]]] = field(default_factory=list)
    lora_id: int = 0          # the sequence's adapter (enable_lora; 0: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    chunks: list[ChunkPlan]
    copies: list[tuple[int, int]]   # (src, dst) block copies to make before the forward
    # Sequences that ended since the last plan: the runner drops what it keeps per sequence.
    finished_seq_ids: list[int] = field(default_factory=list)
    # The second tier (kv.tier_store), in this order: `saves` (block, key): copy the block's
    # bytes to the tier before anything writes to it (it is being reused); `loads` (block,
    # payload): the tier's verified bytes into the block, before the forward reads it;
    # `writes` (block, key): after the forward, write the block (pinned) to the tier in place.
    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, Any]] = field(default_factory=list)
    writes: list[tuple[int, int]] = field(default_factory=list)
    # LoRA adapters paged in the pool (kv.adapter_pages): (adapter id, its blocks) to write
    # before the forward; adapters whose pages went to others (the runner forgets where they were).
    adapter_loads: list[tuple[int, list[int]]] = field(default_factory=list)
    adapter_evictions: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """What a step gives the engine back (plain data, as the plan), by seq id: the token each sampling sequence drew (after
    its accepted drafts, if it speculated), logprobs asked for, sampling errors, accepted
    draft tokens, and the prompt tokens' logprobs scored this step."""
    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    # Of those errors, the ones the request caused (its parameters cannot all be met, e.g. a
    # grammar that min_tokens keeps from ending): the client's error, not the engine's.
    invalid: set[int] = field(default_factory=set)
    accepted: dict[int, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptScores] = field(default_factory=dict)
    # Speculative decoding: each proposing sequence's draft tokens for its next step.
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # SamplingParams.embed: the prompt's last hidden state, float32, by the seq that sampled after it.
    embeddings: dict[int, array] = field(default_factory=dict)
