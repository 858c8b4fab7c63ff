"""What a request's sampling settings do to its logits row before the token is picked:
repetition, frequency and presence penalties, logit_bias, min_tokens and min_p, with
vLLM's meanings (and HF's logits processors' arithmetic).

Only rows whose settings need it are touched, as one batch of tensor operations: a
sequence's history goes into torch once (its token ids), never token by token in Python."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch

from ..plan import SampleTarget


def process_logits(logits: torch.Tensor, rows: list[list[SampleTarget]], eos_ids: Iterable[int] = ()
                   ) -> torch.Tensor:
    """logits [R, V] -> the logits to pick from: `logits` itself when no row needs a pass,
    else a float32 copy with those rows rewritten (logprobs keep reading the raw ones).
    A row serves several sequences only when samples of n fork off it: one history."""
    idx = [i for i, seqs in enumerate(rows) if seqs and seqs[0].params.penalized]
    if not idx:
        return logits
    seqs = [rows[i][0] for i in idx]
    x = logits[torch.tensor(idx, device=logits.device)].float()
    _repetition(x, seqs)
    _frequency_presence(x, seqs)
    _logit_bias(x, seqs)
    _min_tokens(x, seqs, frozenset(eos_ids))
    _min_p(x, seqs)
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    out[torch.tensor(idx, device=logits.device)] = x
    return out


def _which(seqs: list[SampleTarget], pred) -> list[int]:
    return [k for k, s in enumerate(seqs) if pred(s.params)]


def _counts(x: torch.Tensor, histories: list[list[int]]) -> torch.Tensor:
    """[len(histories), V] float: how often each token occurs in each history."""
    lens = torch.tensor([len(h) for h in histories], device=x.device)
    flat = torch.tensor(list(itertools.chain.from_iterable(histories)), dtype=torch.int64, device=x.device)
    rows = torch.repeat_interleave(torch.arange(len(histories), device=x.device), lens)
    counts = torch.zeros(len(histories), x.shape[1], device=x.device)
    return counts.index_put_((rows, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)


def _repetition(x: torch.Tensor, seqs: list[SampleTarget]) -> None:
    """HF's RepetitionPenaltyLogitsProcessor (and vLLM's): every token of the prompt or the
    output has a positive logit divided by the penalty, a negative one multiplied."""
    ks = _which(seqs, lambda p: p.repetition_penalty != 1.0)
    if not ks:
        return
    seen = _counts(x, [seqs[k].token_ids for k in ks]) > 0
    pen = torch.tensor([seqs[k].params.repetition_penalty for k in ks], device=x.device)[:, None]
    sub = x[ks]
    x[ks] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)


def _frequency_presence(x: torch.Tensor, seqs: list[SampleTarget]) -> None:
    """OpenAI's rule, on the output only: logit -= frequency x count + presence x (count > 0)."""
    ks = _which(seqs, lambda p: p.frequency_penalty or p.presence_penalty)
    if not ks:
        return
    counts = _counts(x, [seqs[k].output_token_ids for k in ks])
    freq = torch.tensor([float(seqs[k].params.frequency_penalty) for k in ks], device=x.device)[:, None]
    pres = torch.tensor([float(seqs[k].params.presence_penalty) for k in ks], device=x.device)[:, None]
    x[ks] -= freq * counts + pres * (counts > 0)


def _logit_bias(x: torch.Tensor, seqs: list[SampleTarget]) -> None:
    rows, ids, vals = [], [], []
    for k, s in enumerate(seqs):
        for t, b in (s.params.logit_bias or {}).items():
            if t >= x.shape[1]:
                raise ValueError(f"logit_bias: token id {t} is outside the vocabulary (size {x.shape[1]})")
            rows.append(k), ids.append(t), vals.append(float(b))
    if rows:
        x.index_put_((torch.tensor(rows, device=x.device), torch.tensor(ids, device=x.device)),
                     torch.tensor(vals, device=x.device), accumulate=True)


def _min_tokens(x: torch.Tensor, seqs: list[SampleTarget], eos_ids: frozenset[int]) -> None:
    """Before min_tokens output tokens, nothing that would end the output can be picked
    (vLLM's rule: EOS unless ignore_eos, and stop_token_ids)."""
    rows, ids = [], []
    for k, s in enumerate(seqs):
        p = s.params
        if s.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
            ids += [t for t in stops if t < x.shape[1]]
            rows += [k] * (len(ids) - len(rows))
    if rows:
        x[torch.tensor(rows, device=x.device), torch.tensor(ids, device=x.device)] = -math.inf


def _min_p(x: torch.Tensor, seqs: list[SampleTarget]) -> None:
    """HF's MinPLogitsWarper after the temperature: keep p >= min_p x p_max, that is
    logit >= max + T log(min_p) on the logits before dividing by T. Greedy rows skip it."""
    ks = _which(seqs, lambda p: p.min_p > 0 and not p.greedy)
    if not ks:
        return
    sub = x[ks]
    shift = torch.tensor([s.params.temperature * math.log(s.params.min_p) for s in (seqs[k] for k in ks)],
                         device=x.device)[:, None]
    x[ks] = sub.masked_fill(sub < sub.max(dim=-1, keepdim=True).values + shift, -math.inf)
