"""Proposers of draft tokens, run by the model runner after each step's sampling (as vLLM
v1's): for every sequence the plan asks (SampleTarget.num_spec), the tokens it may carry
as drafts in its next step, returned in StepResult.drafts. The scheduler then schedules
them like any tokens; the verify forward keeps what the target agrees with.

Each proposer keeps its own copy of a proposing sequence's tokens (grown by the tokens
each step adds, copied once), so a plan stays plain data."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import SpeculativeConfig
from ..plan import ChunkPlan, StepPlan, StepResult
from .ngram import NgramIndex


@dataclass(slots=True)
class _Seq:
    tokens: list[int]
    index: NgramIndex | None = None
    # A draft model's KV is right below `valid`; its last proposal also wrote the KV of its
    # first `written` drafts, right after `valid` (kept if the target accepts them).
    valid: int = 0
    written: int = 0


@dataclass
class Proposal:
    """One sequence to propose for: its chunk this step, its tokens now (the step's
    accepted drafts and sampled token included), and how many drafts it may take."""
    chunk: ChunkPlan
    state: _Seq
    accepted: int
    k: int
    resumed: bool   # not the step after its last proposal (new, or recomputed after preemption)


class Proposer:
    """What both proposers share: the per-sequence tokens, and which sequences ask."""

    def __init__(self) -> None:
        self.seqs: dict[int, _Seq] = {}

    def propose(self, plan: StepPlan, res: StepResult) -> dict[int, list[int]]:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        work = []
        for c in plan.chunks:
            t = c.samples[0] if len(c.samples) == 1 else None
            if t is None or not t.num_spec or t.seq_id not in res.tokens:
                continue
            accepted = res.accepted.get(t.seq_id, [])
            st = self.seqs.get(t.seq_id)
            # The step after a proposal computes the token it was made after, at the end of ours.
            resumed = st is None or c.start != len(st.tokens) - 1
            if st is None or len(st.tokens) != len(t.token_ids):  # copied once, then grown
                st = self.seqs[t.seq_id] = _Seq(list(t.token_ids))
            st.tokens += accepted + [res.tokens[t.seq_id]]
            work.append(Proposal(c, st, len(accepted), t.num_spec, resumed))
        return self._drafts(work) if work else {}

    def _drafts(self, work: list[Proposal]) -> dict[int, list[int]]:
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: what followed the latest earlier occurrence of the last n tokens."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        super().__init__()
        self.n_min, self.n_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def _drafts(self, work: list[Proposal]) -> dict[int, list[int]]:
        out = {}
        for w in work:
            st = w.state
            if st.index is None:
                st.index = NgramIndex(self.n_min, self.n_max)
            draft = st.index.propose(st.tokens, w.k)
            if draft:
                out[w.chunk.seq_id] = draft
        return out


class DraftModelProposer(Proposer):
    """A smaller model with the target's tokenizer drafts greedily (runtime/draft.py)."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner = runner

    def _drafts(self, work: list[Proposal]) -> dict[int, list[int]]:
        for w in work:
            st = w.state
            if w.resumed:  # new, or recomputed after preemption: the draft's KV is rebuilt from 0
                st.valid = 0
            else:  # the drafts the target accepted have their draft KV already
                st.valid += min(w.accepted, st.written)
            st.written = 0
        drafts = self.runner.propose(work)
        for w in work:  # its KV now holds every token and the drafts but the last
            w.state.valid = len(w.state.tokens)
            w.state.written = max(0, len(drafts.get(w.chunk.seq_id, [])) - 1)
        return drafts


def make_proposer(cfg: SpeculativeConfig, draft_runner=None) -> Proposer:
    return DraftModelProposer(draft_runner) if cfg.method == "draft_model" else NgramProposer(cfg)
