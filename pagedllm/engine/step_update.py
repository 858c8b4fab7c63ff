"""After the forward: a step's result applied to the sequences, in one place. Computed counts,
forks of pending samples (n > 1), each new token appended with its logprobs and checked for
a stop, and the requests whose sampling failed; the hooks apply their parts (accepted drafts,
beam choices, prompt logprobs). Stop strings come back from the output processor as data
(StopAt) and are applied here too."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..plan import StepResult
from .scheduler import Scheduler
from .sequence import Request, Sequence, SeqStatus
from .step_types import SchedulerOutput, StepUpdate
from .stops import StopRules


@dataclass(frozen=True, slots=True)
class StopAt:
    """The output processor found stop string `stop` ending at output token num_output_tokens."""
    seq: Sequence
    num_output_tokens: int
    stop: str


@dataclass(frozen=True, slots=True)
class Failed:
    """Something went wrong for this request alone (its text could not be made)."""
    request: Request
    error: str


class StepApplier:
    def __init__(self, scheduler: Scheduler, stops: StopRules) -> None:
        self.scheduler, self.stops = scheduler, stops
        self.counters = scheduler.counters

    def apply(self, out: SchedulerOutput, res: StepResult, now: float | None = None) -> StepUpdate:
        now = time.time() if now is None else now
        up = StepUpdate(out, now=now)
        sched, hooks = self.scheduler, self.scheduler.hooks
        self.counters.steps += 1
        self.counters.computed_prompt_tokens += out.num_prefill_tokens
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            run = next((r for h in hooks if (r := h.verified(s, res)) is not None), None)
            if run is not None:  # a hook decided this row's tokens (accepted drafts and the one after)
                self.append(up, seq, run, {}, now)
                continue
            seq.num_computed_tokens = s.start + s.num_tokens
            # Pending samples fork off first: each copies the parent's tokens before any grows.
            sampled = [t for t in s.sample_for if t.seq_id in res.tokens]  # failed ones: below; beams: candidates
            for target in sampled:
                if target is not seq:
                    target.token_ids = list(seq.token_ids)
                    sched.fork(seq, target)
            for target in sampled:
                if res.embeddings and target.seq_id in res.embeddings:
                    target.request.embedding = res.embeddings[target.seq_id]
                self.append(up, target, [res.tokens[target.seq_id]], res.logprobs, now)
        for hook in hooks:
            hook.after_step(out, res, up)
        if res.errors:  # rare: skip the walk over the batch on every ordinary step
            for s in out.scheduled:
                for seq in s.sample_for:
                    if seq.seq_id in res.errors and seq.request.error is None:
                        sched.fail(seq.request, res.errors[seq.seq_id], invalid=seq.seq_id in res.invalid)
                        up.touched[seq.request.request_id] = seq.request
        return up

    def append(self, up: StepUpdate, seq: Sequence, tokens: list[int], logprobs: dict, now: float) -> None:
        """Append a sequence's new tokens one by one, each checked for a stop; a token after
        the one that stopped it is dropped (a verified run of drafts can end early)."""
        req = seq.request
        up.touched[req.request_id] = req
        if req.error is not None:
            return
        for token in tokens:
            if seq.finished:
                break
            seq.token_ids.append(token)
            self.first_token(req, now)
            self.counters.generation_tokens += 1
            lp = logprobs.get(seq.seq_id)
            if lp is not None:
                seq.cumulative_logprob += lp[token].logprob
                if seq.params.logprobs is not None:  # else only best_of's ranking asked for it
                    seq.logprobs.append(lp)
            up.new_tokens.append((seq, token))
            stop = self.stops.after(seq, token)
            if stop is not None:
                self.scheduler.finish(seq, *stop)

    def first_token(self, req: Request, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
            self.counters.prompt_tokens += len(req.prompt_token_ids)

    def stop_at(self, d: StopAt) -> None:
        """A stop string ended the sequence at output token d.num_output_tokens: the tokens
        after it go (not generated, as far as anyone counts), and it stops there, if a length
        limit has not stopped it."""
        seq = d.seq
        extra = seq.num_output_tokens - d.num_output_tokens
        if extra > 0:
            del seq.token_ids[len(seq.token_ids) - extra:]
            del seq.logprobs[d.num_output_tokens:]
            self.counters.generation_tokens -= extra
        if seq.finished:  # by a length limit (or an EOS after the stop string) at the same step
            seq.finish_reason, seq.stop_reason = "stop", d.stop
        else:
            self.scheduler.finish(seq, "stop", d.stop)

    def decide(self, decisions: list[StopAt | Failed]) -> None:
        """Apply the output processor's decisions."""
        for d in decisions:
            if isinstance(d, StopAt):
                self.stop_at(d)
            else:
                self.scheduler.fail(d.request, d.error)
