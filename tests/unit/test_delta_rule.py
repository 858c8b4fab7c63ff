"""Qwen3-Next's gated delta rule over a step's chunks (models/gated_deltanet.py) against the
recurrence written out token by token: a decode step's form, a prefill step's chunked form (the
segments' triangular solve) and the compiled kernel (row by row) give each row's output and leave each block the state after its
last token, whatever the chunks' starts (fresh, from a block's state, mid-block) and lengths
(several blocks, past a segment's rows); the kernel as the model calls it (q, k and v read in
place, L2-normed and mapped from value heads to key heads by the kernel) equals the torch form."""
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


def recur(q, k, v, beta, g, states, meta, compiled: bool) -> torch.Tensor:
    """The torch forms, or the compiled kernel (q and k given normed, one key head a value head)."""
    if not compiled:
        return GatedDeltaNet.recur(q, k, v, beta, g, states, meta)
    from pagedllm.kernels import load_ops

    o = torch.zeros_like(v)
    load_ops().delta_rule(o, q, k, v, beta, g, states, meta.q_starts, meta.read_blocks, meta.fresh, meta.row_writes)
    return o


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
    o = recur(q, k, v, beta, g, states, meta, compiled)
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
            rows.append(recur(q[r], k[r], v[r], beta[r], g[r], states, meta, compiled))
        runs.append((torch.cat(rows), states.clone()))
    assert torch.equal(runs[0][1], runs[1][1])
    # the same numbers but for float32 sums over segments padded to other lengths (40 rows, 8): a
    # float32 state carried on instead would be ~1e-3 off (bf16's rounding of it)
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_norms_q_and_k_and_maps_value_heads_to_key_heads(dtype):
    """As the model calls it: q, k and v read in place from one [T, 2 Hk Dk + H Dv] buffer (the
    convolution's output), q and k L2-normed by the kernel (q then scaled), value head h reading key
    head h // (H / Hk); against the torch form given them normed and repeated, over prefill chunks
    and decodes (a decode's row read from the stored state in place) in a float32 and a bf16 pool."""
    from pagedllm.kernels import load_ops

    hk, h = 2, 4
    chunks = [(0, 70), (37, 41), (20, 21), (16, 17), (3, 4)]
    _, _, t, meta = step_of(chunks)
    torch.manual_seed(4)
    buf = torch.randn(t, 2 * hk * DK + h * DV + 5)   # a row stride of its own, as a split view has
    q, k, v = buf[:, :hk * DK], buf[:, hk * DK:2 * hk * DK], buf[:, 2 * hk * DK:2 * hk * DK + h * DV]
    beta, g = torch.rand(t, h), -torch.rand(t, h) * 2
    states = (torch.randn(BLOCKS * 10, h, DK, DV) * 0.3).to(dtype)
    theirs = states.clone()
    o = torch.zeros(t, h, DV)
    load_ops().delta_rule(o, q.view(t, hk, DK), k.view(t, hk, DK), v.view(t, h, DV), beta, g, states, meta.q_starts,
                          meta.read_blocks, meta.fresh, meta.row_writes, True, DK ** -0.5)
    qn = l2norm(q.reshape(t, hk, DK)).repeat_interleave(h // hk, dim=1) * DK ** -0.5
    kn = l2norm(k.reshape(t, hk, DK)).repeat_interleave(h // hk, dim=1)
    want = GatedDeltaNet.recur(qn, kn, v.reshape(t, h, DV), beta, g, theirs, meta)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o, want, atol=tol, rtol=tol)
    torch.testing.assert_close(states.float(), theirs.float(), atol=tol, rtol=tol)
