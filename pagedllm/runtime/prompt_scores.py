"""Prompt logprobs: each scored prompt row's next token, its logprob and rank and the top k,
computed from the step's hidden states a slice of rows at a time."""
from __future__ import annotations

from array import array

import torch

from ..distributed import TPGroup
from ..plan import PromptScores
from .step_inputs import StepInputs

# Prompt rows scored per logits matmul: 256 x 49152 float32 is 48 MiB.
SCORE_ROWS = 256


def score_prompt(model, tp: TPGroup, hidden: torch.Tensor, step: StepInputs) -> list[torch.Tensor]:
    """Each scored row's next prompt token: [its logprob, its rank, the top-k ids, their
    logprobs] for all rows (k: the step's largest), on the CPU (rank 0; the other ranks
    take part in the gathers and return []). Rows go SCORE_ROWS at a time: a whole
    prompt's float32 logits would take rows x vocab x 4 bytes at once."""
    parts: list[list[torch.Tensor]] = []
    k = max(step.score_top)
    for i in range(0, len(step.score_rows), SCORE_ROWS):
        rows = torch.tensor(step.score_rows[i:i + SCORE_ROWS], device=hidden.device)
        logits = tp.gather_vocab(model.compute_logits(hidden[rows]))
        if logits is None:
            continue
        want = torch.tensor(step.score_ids[i:i + SCORE_ROWS], device=logits.device)
        kernels = model.ops.k
        if kernels is not None and logits.device.type == "cpu":  # two passes a row, in place
            parts.append(list(kernels.score_rows(logits.contiguous(), want, k)))
            continue
        # logprob = logit - logsumexp: no [rows, vocab] log_softmax is written, only read.
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        raw = logits.gather(1, want[:, None])
        ranks = (logits > raw).sum(dim=-1, dtype=torch.int32) + 1  # int32: half the int64 sum's time
        top = torch.topk(logits, k, dim=-1)
        parts.append([(raw - lse)[:, 0], ranks, top.indices, top.values - lse])
    return [torch.cat(p).cpu() for p in zip(*parts)] if parts else []


def split_scores(scores: list[torch.Tensor], scored: list[tuple[int, int, int]]) -> dict[int, PromptScores]:
    """The step's scored rows as each sequence's PromptScores, at its own k."""
    if not scores:
        return {}
    chosen, ranks, ids, lps = scores
    out, i = {}, 0
    for seq_id, n, k in scored:
        out[seq_id] = PromptScores(k, array("f", chosen[i:i + n].numpy().tobytes()),
                                   array("i", ranks[i:i + n].to(torch.int32).numpy().tobytes()),
                                   array("i", ids[i:i + n, :k].to(torch.int32).contiguous().numpy().tobytes()),
                                   array("f", lps[i:i + n, :k].contiguous().numpy().tobytes()))
        i += n
    return out
