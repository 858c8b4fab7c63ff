"""Prompt logprobs (SamplingParams.prompt_logprobs), kept with cached blocks: the engine's side.

With the prefix cache on, every prompt-logprob request is scored at one top k (max_logprobs),
and each full prompt block whose tokens all have their logprobs keeps them beside it (the KV
manager's score store), so a later request over the same prefix (lm-eval's shared few-shot
context) takes them instead of computing them. A hit whose blocks keep no logprobs is
re-read from the first token without them (those rows write no KV); a request whose next
block is being scored by a running one waits a step for it instead.
"""
from __future__ import annotations

from ..plan import ChunkPlan, PromptScores, StepResult
from .hooks import StepHook
from .sequence import Sequence
from .step_types import ScheduledSeq, SchedulerOutput, StepUpdate, Wait

SCORES_PENDING = Wait("its prompt logprobs are being computed by a running request")


class PromptScoring(StepHook):
    def __init__(self, max_logprobs: int) -> None:
        # Prompt logprobs are scored at this top k when the prefix cache keeps them beside
        # its blocks (every later request must find its k there), else at each request's.
        self.max_logprobs = max_logprobs
        self._keys: set[int] | None = None   # keys being scored by running sequences, this step

    @property
    def kv(self):
        return self.scheduler.kv

    def new_scores(self, k: int) -> PromptScores:
        """Empty prompt scores for a request asking the top k, at the k it will be scored at."""
        return PromptScores(self.max_logprobs if self.kv.enable_prefix_caching else k)

    def keeps(self, seq: Sequence) -> bool:
        """Whether a sequence's prompt blocks get their logprobs kept as it computes them."""
        scores = seq.request.prompt_scores
        return self.kv.enable_prefix_caching and seq.index == 0 and scores is not None and \
            scores.k == self.max_logprobs

    def scored_blocks(self, seq: Sequence) -> int:
        """Full prompt blocks whose every token has its logprob now (block b's from index b*B - 1)."""
        return min(len(seq.request.prompt_scores) + 1, seq.num_prompt_tokens) // self.kv.block_size

    # -- admission -----------------------------------------------------------
    def begin_step(self) -> None:
        self._keys = None

    def _scoring(self) -> set[int]:
        """The keys of the prompt blocks whose logprobs running sequences will keep once
        computed, built on first use in a step's admission and grown as it admits."""
        if self._keys is None:
            self._keys = set()
            for seq in self.scheduler.running:
                self._add(seq)
        return self._keys

    def _add(self, seq: Sequence) -> None:
        if self.keeps(seq):
            self._keys.update(seq.hashes.keys[self.scored_blocks(seq):seq.num_prompt_tokens // self.kv.block_size])

    def admit(self, seq, hit, start, alone):
        """Computing starts after the prefix hit, or for prompt logprobs at the first token the
        cache keeps no logprobs for, less one (that row scores it), however far the KV hit
        goes; the kept ones go into the request. Waits when a running request is computing
        the logprobs of the first hit block that has none (the choices of one question
        arrive together; one computes their context)."""
        scores = seq.request.prompt_scores
        if scores is None or seq.index != 0:
            return hit, start
        kept = self.kv.scores.kept(seq.hashes.keys[:len(hit)])
        if alone and len(kept) < len(hit) and seq.hashes.keys[len(kept)] in self._scoring():
            return SCORES_PENDING
        if kept and len(kept) * self.kv.block_size - 1 > len(scores):
            joined = PromptScores(scores.k)
            for entry in kept:
                joined.extend(entry)
            seq.request.prompt_scores = scores = joined
        return hit, min(start, len(scores))

    def admitted(self, seq: Sequence) -> None:
        req = seq.request
        if req.prompt_scores is None:
            return
        if seq.num_output_tokens == 0 and seq.index == 0 and self.kv.enable_prefix_caching:
            self.kv.scores.count(seq.num_prompt_tokens - 1, len(req.prompt_scores))
        if self._keys is not None:
            self._add(seq)

    # -- the plan and the result ---------------------------------------------
    def plan(self, chunk: ChunkPlan, s: ScheduledSeq) -> None:
        """The prompt tokens this chunk's rows score, those not scored yet (a recompute after
        preemption scores nothing twice)."""
        seq = s.seq
        got = seq.request.prompt_scores
        if got is None or seq.index != 0:
            return
        first, last = max(chunk.start, len(got)), min(chunk.end, seq.num_prompt_tokens - 1)
        if first < last:
            chunk.score_start, chunk.score_ids = first, seq.token_ids[first + 1:last + 1]
            chunk.score_top = got.k

    def after_step(self, out: SchedulerOutput, res: StepResult, up: StepUpdate) -> None:
        """A step's prompt logprobs into their requests; each full prompt block whose tokens
        all have theirs now keeps them beside it (block b: tokens b*B .. b*B+B-1, held from
        index b*B - 1, as token 0 has none)."""
        if not res.prompt_logprobs:
            return
        B = self.kv.block_size
        for s in out.scheduled:
            seq = s.seq
            new = res.prompt_logprobs.get(seq.seq_id)
            scores = seq.request.prompt_scores
            if new is None or scores is None:
                continue
            done = self.scored_blocks(seq)
            scores.extend(new)
            if self.keeps(seq):
                for b in range(done, self.scored_blocks(seq)):
                    if b < len(seq.hashes.keys):
                        self.kv.scores.keep(seq.hashes.keys[b], scores.slice(max(b * B - 1, 0), (b + 1) * B - 1))
