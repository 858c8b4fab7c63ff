"""A step's tokens from its logits rows: grammars masked, drafts verified, embeddings kept, the
rest sampled; greedy rows the LM head's argmax kernel already decided are taken as they are.
Keeps what lives per sequence on rank 0: each sampling sequence's RNG and grammar matcher."""
from __future__ import annotations

from array import array

import torch

from ..plan import SampleTarget, StepResult
from .grammar import GrammarMatchers, GrammarRow
from .rejection import Verify, verify
from .sampler import sample
from .step_inputs import RowRoles


def _argmax_only(t: SampleTarget) -> bool:
    """Whether a sequence's next token is its logits' argmax and nothing else reads them."""
    p = t.params
    return p.greedy and p.logprobs is None and not p.ranks_samples and not p.penalized \
        and not t.beam_candidates and t.grammar is None


class TokenPicker:
    def __init__(self, kernels) -> None:
        self.kernels = kernels   # the compiled CPU kernels (sampling's top-k, grammar masks) or None
        self.generators: dict[int, torch.Generator] = {}   # seeded on first use, kept until the sequence ends
        self.grammars: GrammarMatchers | None = None     # structured outputs' matchers, built on first use

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences that finished: their RNGs and matchers go."""
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
            if self.grammars is not None:
                self.grammars.drop(seq_id)

    def reset(self) -> None:
        self.generators.clear()
        self.grammars = None

    @staticmethod
    def argmax_rows(roles: RowRoles) -> list[int]:
        """The sampled rows whose token is their logits' argmax and whose logits nobody else
        reads (greedy; no logprobs, penalties, grammar, beam or embedding): the head's kernel
        can give their tokens without writing their logits. A step that verifies drafts keeps
        every row's logits."""
        if roles.checks:
            return []
        skip = {i for i, _ in roles.embeds}
        return [i for i, ts in roles.sample if i not in skip and all(map(_argmax_only, ts))]

    @staticmethod
    def take_greedy(roles: RowRoles, greedy: dict[int, int], out: StepResult) -> None:
        """The tokens of the rows the head's argmax decided (by their logits row); the other
        sampled rows renumbered as the rows of the logits that came without them."""
        rest, taken = [], 0
        for i, ts in roles.sample:   # in the order of their rows, as the logits
            if i in greedy:
                out.tokens.update((t.seq_id, greedy[i]) for t in ts)
                taken += 1
            else:
                rest.append((i - taken, ts))
        roles.sample = rest

    def pick(self, logits: torch.Tensor, roles: RowRoles, hidden: torch.Tensor, eos: frozenset[int],
             out: StepResult) -> None:
        """The step's tokens from its logits rows (`hidden`: the same rows' hidden states, read
        for the embeddings asked)."""
        sample_rows, checks = roles.sample, roles.checks
        constrained = self._constrained(sample_rows, checks)
        if constrained:
            refused, invalid = self._matchers(logits).mask(logits, constrained)
            if refused:  # those sequences fail alone: they sample nothing
                sample_rows = [(i, [t for t in ts if t.seq_id not in refused]) for i, ts in sample_rows]
                sample_rows = [(i, ts) for i, ts in sample_rows if ts]
                checks = [c for c in checks if c.target.seq_id not in refused]
            out.errors.update(refused)
            out.invalid.update(invalid)
        if checks:
            out.accepted, out.tokens, errors = verify(logits, checks, eos, self.generators)
            out.errors.update(errors)
        for i, seq_id in roles.embeds:
            # its one row samples after the prompt's last token: a pooling request's only
            # generated token, which nobody reads
            out.embeddings[seq_id] = array("f", hidden[i].float().cpu().numpy().tobytes())
        if sample_rows:
            rows = logits if not checks else logits[torch.tensor([i for i, _ in sample_rows], device=logits.device)]
            tokens, out.logprobs, errors = sample(rows, [t for _, t in sample_rows], self.kernels, eos,
                                                  self.generators)
            out.tokens.update(tokens)
            out.errors.update(errors)
        if constrained:
            self._advance(constrained, out)

    @staticmethod
    def _constrained(sample_rows: list, checks: list[Verify]) -> list[GrammarRow]:
        """The rows a grammar constrains: a row's first target speaks for the samples of n
        that fork off it (they all start from the same output, none)."""
        rows = [GrammarRow(i, ts[0], []) for i, ts in sample_rows
                if ts[0].grammar is not None and ts[0].grammar_from is not None]
        rows += [GrammarRow(c.row, c.target, c.draft) for c in checks
                 if c.target.grammar is not None and c.target.grammar_from is not None]
        return rows

    def _matchers(self, logits: torch.Tensor) -> GrammarMatchers:
        if self.grammars is None:
            self.grammars = GrammarMatchers(logits.shape[-1], self.kernels)
        return self.grammars

    def _advance(self, constrained: list[GrammarRow], out: StepResult) -> None:
        """Each matcher takes the tokens its sequence keeps (accepted drafts, the new token);
        the other samples of a row build theirs from their tokens next step."""
        for r in constrained:
            sid = r.target.seq_id
            if sid in out.tokens and sid not in out.errors:
                error = self.grammars.advance(r.target, out.accepted.get(sid, []) + [out.tokens[sid]])
                if error is not None:
                    out.errors[sid] = error
                    out.invalid.add(sid)
                    out.tokens.pop(sid)
                    out.accepted.pop(sid, None)
