"""Turns logits rows into tokens: greedy, or temperature / top-k / top-p sampling with a
seeded generator per sequence, so a seed reproduces whatever else is in the batch.

Sampled rows are drawn by the Gumbel-max race (argmax of log-probability plus Gumbel
noise), which a tiny numeric change in the logits flips only on a near tie. On CPU the
compiled kernel (kernels/csrc/sampling.cpp) does every row at once from one 64-bit draw
of the sequence's generator; elsewhere each row draws its exponentials with torch."""
from __future__ import annotations

import torch

from ..plan import SampleTarget
from ..outputs import Logprob
from .logits_processors import process_logits


def sample(logits: torch.Tensor, rows: list[list[SampleTarget]], kernels=None, eos_ids: frozenset[int] = frozenset(),
           generators: dict[int, torch.Generator] | None = None
           ) -> tuple[dict[int, int], dict[int, dict[int, Logprob]], dict[int, str]]:
    """logits [R, V]; rows[i] lists the sequences that sample from row i. Returns tokens
    and logprobs by seq id, and the error of each sequence whose sampling failed: one bad
    request must not fail the others of the batch, so a failed batch is redone row by row.
    Penalties, logit_bias, min_tokens (against `eos_ids`) and min_p apply first.
    `generators` keeps each sequence's RNG between calls (by seq id; the runner's).
    A beam's entry in the logprobs is its top candidates, best first, and it gets no token."""
    gens = {} if generators is None else generators
    if any(s.beam_candidates for seqs in rows for s in seqs):
        beams = _beam_candidates(logits, rows)
        rows = [[s for s in seqs if not s.beam_candidates] for seqs in rows]
        tokens, logprobs, errors = sample(logits, rows, kernels, eos_ids, gens)
        return tokens, {**logprobs, **beams}, errors
    try:
        tokens = _sample_batch(process_logits(logits, rows, eos_ids), rows, kernels, gens)
        return tokens, _logprobs(logits, rows, tokens), {}
    except Exception:  # find which rows fail; every other row keeps its token
        tokens, logprobs, errors = {}, {}, {}
        for i, seqs in enumerate(rows):
            for seq in seqs:
                try:
                    one = _sample_batch(process_logits(logits[i:i + 1], [[seq]], eos_ids), [[seq]], kernels, gens)
                    logprobs.update(_logprobs(logits[i:i + 1], [[seq]], one))
                    tokens.update(one)
                except Exception as e:
                    errors[seq.seq_id] = f"sampling failed: {type(e).__name__}: {e}"
        return tokens, logprobs, errors


def _beam_candidates(logits: torch.Tensor, rows: list[list[SampleTarget]]) -> dict[int, dict[int, Logprob]]:
    """Each beam row's best tokens under log_softmax of its float32 logits (HF's beam
    scores), one batched top-k for all of them."""
    picks = [(i, s) for i, seqs in enumerate(rows) for s in seqs if s.beam_candidates]
    idx = torch.tensor([i for i, _ in picks], device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    top = torch.topk(lp, min(max(s.beam_candidates for _, s in picks), lp.shape[-1]), dim=-1)
    values, ids = top.values.tolist(), top.indices.tolist()
    return {s.seq_id: {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids[j][:s.beam_candidates],
                                                                        values[j][:s.beam_candidates]), 1)}
            for j, (_, s) in enumerate(picks)}


def _sample_batch(logits: torch.Tensor, rows: list[list[SampleTarget]], kernels, gens: dict) -> dict[int, int]:
    """Greedy rows take the argmax in the logits' own dtype (upcasting cannot change it)."""
    out: dict[int, int] = {}
    picks = [(i, seq) for i, seqs in enumerate(rows) for seq in seqs if not seq.params.greedy]
    if len(picks) < sum(map(len, rows)):
        if kernels is not None and logits.device.type == "cpu" and logits.is_contiguous():
            greedy = kernels.argmax_rows(logits).tolist()  # torch's max(dim) below, in vector lanes, rows in parallel
        else:  # max(dim).indices: the first maximal index like argmax, but vectorized on CPU (2x faster).
            greedy = logits.max(dim=-1).indices.tolist()
        for i, seqs in enumerate(rows):
            for seq in seqs:
                if seq.params.greedy:
                    out[seq.seq_id] = greedy[i]
    if picks:
        if kernels is not None and logits.device.type == "cpu":
            tokens = _sample_kernel(kernels, logits, picks, gens)
        else:
            tokens = [_sample_torch(logits[i], seq, gens) for i, seq in picks]
        for (_, seq), t in zip(picks, tokens):
            out[seq.seq_id] = t
    return out


def generator(seq: SampleTarget, gens: dict[int, torch.Generator]) -> torch.Generator:
    g = gens.get(seq.seq_id)
    if g is None:
        g = gens[seq.seq_id] = torch.Generator().manual_seed(seq.seed)
    return g


def _sample_kernel(kernels, logits: torch.Tensor, picks: list[tuple[int, SampleTarget]], gens: dict) -> list[int]:
    params = [seq.params for _, seq in picks]
    rows = logits[torch.tensor([i for i, _ in picks])].contiguous()
    # One draw per sequence and step keys the kernel's noise for the whole row.
    seeds = torch.stack([torch.empty((), dtype=torch.int64).random_(generator=generator(seq, gens)) for _, seq in picks])
    return kernels.sample(rows, torch.tensor([float(p.temperature) for p in params], dtype=torch.float32),
                          torch.tensor([p.top_k for p in params], dtype=torch.int64),
                          torch.tensor([float(p.top_p) for p in params], dtype=torch.float32), seeds).tolist()


def _sample_torch(row: torch.Tensor, seq: SampleTarget, gens: dict) -> int:
    return race(weights(row, seq.params), generator(seq, gens))


def race(w: torch.Tensor, gen: torch.Generator) -> int:
    """A token drawn with probability w / w.sum(): the exponential race (Gumbel-max)."""
    noise = torch.empty(w.shape, dtype=torch.float32).exponential_(generator=gen).to(w.device)
    return int((w / noise).argmax())


def weights(row: torch.Tensor, p) -> torch.Tensor:
    """A row's unnormalised sampling probabilities [V] float32 under temperature, top-k
    and top-p (`p`: the SamplingParams)."""
    # Shift by the max before dividing: values stay <= 0 and finite (or -inf) however small
    # the temperature; a temperature below float32's range acts as greedy. NaN logits are
    # out; +inf ones (a repetition penalty near 0 divides by it) share the top, as the kernel's.
    x = torch.nan_to_num(row.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = x.max()
    x = torch.where(x == top, 0.0, float("-inf")) if top == float("inf") else x - top
    x = x / min(max(float(p.temperature), 1e-30), 1e20)  # the kernel's bounds (sampling.cpp)
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    w = x.exp()
    if p.top_p < 1.0:
        # Best first by score, ties to the lower index: the kernel's order. (Weights tie where scores
        # do not: under a high temperature every exp(s) rounds to nearly 1.)
        order = x.argsort(descending=True, stable=True)
        sw = w[order]
        cum = sw.double().cumsum(0)
        drop = cum - sw.double() >= p.top_p * cum[-1]
        drop[0] = False  # the top token always stays, even for a top_p below float32's range
        w = torch.zeros_like(w).scatter_(0, order, sw.masked_fill(drop, 0.0))
    return w


def _logprobs(logits: torch.Tensor, rows: list[list[SampleTarget]], tokens: dict[int, int]
              ) -> dict[int, dict[int, Logprob]]:
    """vLLM's shape, from the raw logits: the chosen token first, then the top k by rank."""
    logprobs: dict[int, dict[int, Logprob]] = {}
    for i, seqs in enumerate(rows):
        row_lp = None
        for seq in seqs:
            p = seq.params
            if p.logprobs is None and not p.ranks_samples:
                continue
            if row_lp is None:
                row_lp = torch.log_softmax(logits[i].float(), dim=-1)
            token = tokens[seq.seq_id]
            top = torch.topk(row_lp, p.logprobs) if p.logprobs else None
            top_ids = top.indices.tolist() if top is not None else []
            chosen = float(row_lp[token])
            rank = top_ids.index(token) + 1 if token in top_ids else int((row_lp > chosen).sum()) + 1
            entry = {token: Logprob(chosen, rank)}
            for r, (t, v) in enumerate(zip(top_ids, top.values.tolist() if top is not None else []), 1):
                entry.setdefault(t, Logprob(v, r))
            logprobs[seq.seq_id] = entry
    return logprobs
