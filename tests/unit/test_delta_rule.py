"""Qwen3-Next's gated delta rule over a step's chunks (models/gated_deltanet.py) against the
recurrence written out token by token: a decode step's form, a prefill step's chunked form (the
segments' triangular solve) and the compiled kernel (row by row) give each row's output and leave each block the state after its
last token, whatever the chunks' starts (fresh, from a block's state, mid-block) and lengths
(several blocks, past a segment's rows)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.models.gated_deltanet import GatedDeltaNet, l2norm

from .test_mamba_scan import B, step_of

H, DK, DV = 3, 8, 16
BLOCKS = 32


def reference(q, k, v, beta, g, start_state: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence's rows, token by token (the rule as transformers' recurrent form writes it)."""
    s, outs, states = start_state.clone(), [], []
    for i in range(q.shape[0]):
        s = s * torch.exp(g[i])[:, None, None]
        delta = (v[i] - (s * k[i][:, :, None]).sum(-2)) * beta[i][:, None]
        s = s + k[i][:, :, None] * delta[:, None, :]
        outs.append((s * q[i][:, :, None]).sum(-2))
        states.append(s.clone())
    return torch.stack(outs), states


def kernels_or_none(compiled: bool):
    if not compiled:
        return None
    from pagedllm.kernels import load_ops

    return load_ops()


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "compiled"])
@pytest.mark.parametrize("chunks", [
    [(0, 70), (37, 41), (20, 21), (16, 16 + 80)],   # fresh over blocks and segments; from a state; a decode
    [(5, 6), (31, 32), (0, 1)],                     # a decode step
])
def test_both_forms_equal_the_recurrence(chunks, compiled):
    tables, q_starts, t, meta = step_of(chunks)
    torch.manual_seed(2)
    q, k = l2norm(torch.randn(t, H, DK)) * DK ** -0.5, l2norm(torch.randn(t, H, DK))
    v, beta = torch.randn(t, H, DV), torch.rand(t, H)
    g = -torch.rand(t, H) * 2   # strong and weak decays
    states = torch.randn(BLOCKS * 10, H, DK, DV) * 0.3
    before = states.clone()
    o = GatedDeltaNet.recur(q, k, v, beta, g, states, meta, kernels_or_none(compiled))
    for i, (s0, e) in enumerate(chunks):
        r = slice(q_starts[i], q_starts[i + 1])
        start = before[tables[i][(s0 - 1) // B]] if s0 else torch.zeros(H, DK, DV)
        want, after = reference(q[r], k[r], v[r], beta[r], g[r], start)
        torch.testing.assert_close(o[r], want, atol=2e-4, rtol=2e-4)
        for j, p in enumerate(range(s0, e)):
            if p % B == B - 1 or p == e - 1:   # a block end or the chunk's end: its state is kept
                torch.testing.assert_close(states[tables[i][p // B]], after[j], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "compiled"])
def test_a_chunk_goes_on_from_its_state_as_stored(compiled):
    """In a bf16 pool, a chunk run whole and the same chunk restarted at a block end from the state
    stored there (a prefix hit, a recompute) leave the same state and give the same rows: the whole
    chunk carries on from the stored (rounded) state, not its float32 one."""
    torch.manual_seed(3)
    t = 40
    q, k = l2norm(torch.randn(t, H, DK)) * DK ** -0.5, l2norm(torch.randn(t, H, DK))
    v, beta, g = torch.randn(t, H, DV), torch.rand(t, H), -torch.rand(t, H) * 2
    runs = []
    for cut in (0, 2 * B):   # whole; or to the end of block 1, then on from its stored state
        states = torch.zeros(BLOCKS, H, DK, DV, dtype=torch.bfloat16)
        rows = []
        for s0, e in ((0, cut), (cut, t)) if cut else ((0, t),):
            _, _, _, meta = step_of([(s0, e)])
            r = slice(s0, e)
            rows.append(GatedDeltaNet.recur(q[r], k[r], v[r], beta[r], g[r], states, meta, kernels_or_none(compiled)))
        runs.append((torch.cat(rows), states.clone()))
    assert torch.equal(runs[0][1], runs[1][1])
    # the same numbers but for float32 sums over segments padded to other lengths (40 rows, 8): a
    # float32 state carried on instead would be ~1e-3 off (bf16's rounding of it)
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-6, rtol=0)
