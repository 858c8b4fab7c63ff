"""Beam search's part in a step: once every live beam of a group has its candidates (the
runner's top tokens with their logprobs), choose the next beams (beam.BeamGroup, pure) and
apply the choice to block tables: a beam chosen once extends itself, chosen again forks
(shared blocks, copy-on-write of the partial last one), not chosen is freed now."""
from __future__ import annotations

from typing import Callable

from ..plan import StepResult
from .hooks import StepHook
from .sequence import Request, Sequence
from .step_types import SchedulerOutput, StepUpdate
from .stops import StopRules


class BeamSearch(StepHook):
    def __init__(self, stops: StopRules, first_token: Callable[[Request, float], None]) -> None:
        """first_token(req, now): a request's first token came (its time, the prompt counted)."""
        self.stops, self.first_token = stops, first_token

    def after_step(self, out: SchedulerOutput, res: StepResult, up: StepUpdate) -> None:
        if not res.logprobs:   # beams' candidates come as logprobs
            return
        for req in self._ready(out, res.logprobs):
            up.touched[req.request_id] = req
            up.new_tokens += self._advance(req, up.now)

    @staticmethod
    def _ready(out: SchedulerOutput, logprobs: dict) -> list[Request]:
        """Beam groups whose live beams all have their candidates after this step."""
        ready: dict[str, Request] = {}
        for s in out.scheduled:
            for seq in s.sample_for:
                req = seq.request
                if req.beam is not None and seq.seq_id in logprobs and not seq.finished:
                    req.candidates[seq.seq_id] = [(t, lp.logprob) for t, lp in logprobs[seq.seq_id].items()]
                    if all(b.seq_id in req.candidates for b in req.beams):
                        ready[req.request_id] = req
        return list(ready.values())

    def _advance(self, req: Request, now: float) -> list[tuple[Sequence, int]]:
        beams, group, sched = req.beams, req.beam, self.scheduler
        ignore_eos = group.params.ignore_eos

        def ends(token: int, gen_len: int) -> str | None:
            if not ignore_eos and token in self.stops.eos_token_ids:
                return "stop"
            return "length" if self.stops.at_length_limit(req, gen_len) else None
        chosen = group.step([req.candidates.pop(b.seq_id) for b in beams], [b.output_token_ids for b in beams], ends)
        self.first_token(req, now)
        extended: set[int] = set()
        nxt: list[Sequence] = []
        for c in chosen:  # forks first: a child copies its parent's tokens before the parent grows
            parent = beams[c.beam]
            if c.beam in extended:
                child = Sequence(sched.new_seq_id(), req, len(req.seqs), parent.token_ids + [c.token],
                                 len(req.prompt_token_ids), parent.seed)
                req.seqs.append(child)
                sched.fork(parent, child)
                nxt.append(child)
            else:
                extended.add(c.beam)
                nxt.append(parent)
        for seq, c in zip(nxt, chosen):
            if seq is beams[c.beam]:
                seq.token_ids.append(c.token)
        for i, b in enumerate(beams):
            if i not in extended:
                sched.finish(b, "pruned")
        req.beams = [] if group.done else nxt
        if group.done:
            for b in nxt:
                sched.finish(b, "stop")
        sched.counters.generation_tokens += len(chosen)
        return [(seq, c.token) for seq, c in zip(nxt, chosen)]
