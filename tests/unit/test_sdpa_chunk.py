"""attention/fresh_prefill.py's sdpa_chunk: a chunk's causal attention, fresh or after keys (multi-head latent
attention's expanded prefill, models/mla.py) against attention written out with its mask."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.fresh_prefill import sdpa_chunk


def _reference(q, k, v, scale):
    n, s = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    seen = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]   # query i: keys up to s - n + i
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double())


@pytest.mark.parametrize("rows,keys", [(1, 1), (5, 5), (5, 40), (33, 97), (64, 64)])
def test_a_chunk_sees_every_key_before_it_and_its_own_up_to_itself(rows, keys):
    g = torch.Generator().manual_seed(rows * 1000 + keys)
    q, k, v = (torch.randn(n, 3, 24, generator=g) for n in (rows, keys, keys))
    got = sdpa_chunk(q, k, v, 0.2)
    torch.testing.assert_close(got.double(), _reference(q, k, v, 0.2), atol=1e-5, rtol=1e-5)
