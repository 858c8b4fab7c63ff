"""Beam search inside the engine: one group of sequences per request, k beams wide.

Each step every live beam of the group yields its top 2k next tokens with their
log-probabilities (one batched log-softmax in the runner). The group then keeps, like
HF's `generate(num_beams=k)`: the 2k best (beam, token) candidates by cumulative
log-probability; among the first k, those that end (EOS, or the length limit) become
finished hypotheses scored sum / generated_len ** length_penalty; the best k candidates
that do not end become the next beams. The engine turns that choice into block-table
operations: a beam chosen once extends its own sequence, a beam chosen twice forks (its
blocks shared by ref count, the partial last one copied on write), a beam not chosen is
freed at once. Plain Python, no torch: the choice is a few dozen numbers per step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..sampling_params import BeamSearchParams


@dataclass(slots=True)
class Candidate:
    beam: int            # index into the group's live beams
    token: int
    cumulative: float    # the beam's cumulative log-probability plus this token's


@dataclass(slots=True)
class Hypothesis:
    output_ids: list[int]   # generated tokens, the ending one (EOS) included
    cumulative: float       # sum of the tokens' log-probabilities
    score: float            # cumulative / len(output_ids) ** length_penalty
    finish_reason: str      # "stop" (EOS) or "length"


@dataclass
class BeamGroup:
    """The search state of one request; beams are referred to by their index in `live`."""
    params: BeamSearchParams
    num_eos: int = 1          # EOS ids that can end a beam (HF keeps more candidates per EOS id)
    max_tokens: int = 0       # the request's, resolved (params may leave it to max_model_len)
    live_scores: list[float] = field(default_factory=lambda: [0.0])  # cumulative logprob per live beam
    finished: list[Hypothesis] = field(default_factory=list)         # best first, at most k
    improvable: bool = True   # HF's early-stop heuristic: can a live beam still beat the worst kept?
    done: bool = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        """Candidates kept per step, and asked of each beam: (1 + EOS ids) x k, at least 2k,
        so k live beams remain however many of the best end (HF's beams_to_keep)."""
        return max(2, 1 + self.num_eos) * self.width

    def step(self, candidates: list[list[tuple[int, float]]], outputs: list[list[int]],
             ends: Callable[[int, int], str | None]) -> list[Candidate]:
        """One search step. candidates[b]: beam b's (token, logprob) best first; outputs[b]:
        its generated tokens so far; ends(token, generated_len) -> finish reason or None.
        Returns the next live beams, best first; updates finished hypotheses and `done`."""
        k, lp = self.width, self.params.length_penalty
        pool = [Candidate(b, t, self.live_scores[b] + v) for b, cands in enumerate(candidates) for t, v in cands]
        # Stable on ties in (beam, rank) order, as a top-k over the flattened [beams x vocab].
        pool.sort(key=lambda c: -c.cumulative)
        pool = pool[:self.num_candidates]
        gen_len = len(outputs[0]) + 1
        may_add = self._may_add()  # decided on the state before this step, as HF's masks are
        nxt: list[Candidate] = []
        for rank, c in enumerate(pool):
            reason = ends(c.token, gen_len)
            if reason is None:
                if len(nxt) < k:
                    nxt.append(c)
            elif rank < k and may_add:
                self._add(Hypothesis(outputs[c.beam] + [c.token], c.cumulative, c.cumulative / gen_len ** lp, reason))
        all_end = len(nxt) == 0
        self.live_scores = [c.cumulative for c in nxt]
        self._update_improvable(gen_len)
        self.done = all_end or not self.improvable or (self.params.early_stopping is True and self._full())
        return nxt

    def _full(self) -> bool:
        return len(self.finished) >= self.width

    def _may_add(self) -> bool:
        # HF: nothing more is kept once every slot holds a hypothesis under early_stopping=True,
        # nor once no live beam can improve on the worst kept one.
        return self.improvable and not (self.params.early_stopping is True and self._full())

    def _add(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: an earlier hypothesis wins a tie
        del self.finished[self.width:]

    def _update_improvable(self, gen_len: int) -> None:
        """HF's heuristic: the best live beam's score at the most favourable length it could
        still reach against the worst kept hypothesis, once all k slots hold one. Sticky."""
        if not self.improvable or not self._full() or not self.live_scores:
            return
        lp = self.params.length_penalty
        if self.params.early_stopping == "never" and lp > 0:
            best_len = self.max_tokens
        else:
            best_len = gen_len
        best_possible = self.live_scores[0] / best_len ** lp
        self.improvable = best_possible > min(h.score for h in self.finished)

    def results(self) -> list[Hypothesis]:
        return list(self.finished)
