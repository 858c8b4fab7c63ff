"""Mamba-2's selective scan over a step's chunks (models/mamba2.py) against the recurrence written
out token by token: a decode step's one-offset form, a prefill step's chunked form and the compiled
kernel (row by row, kernels/csrc/state_scans.cpp) give each
row's output and leave each block the state after its last token, whatever the chunks' starts
(fresh, from a block's state, mid-block) and lengths (several blocks, past a segment's rows)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.models.config import ModelConfig
from pagedllm.models.mamba2 import Mamba2Mixer
from pagedllm.models.mamba_config import MambaConfig
from pagedllm.models.state_step import state_steps

H, P, N, G, B = 4, 8, 16, 2, 16
BLOCKS = 32


def mixer(p: int = P, n: int = N) -> Mamba2Mixer:
    cfg = ModelConfig("granitemoehybrid", 32, 1, 2, 2, 16, 64, 100, 1e-5, 1e4, None, 512, False, False,
                      state_layers=(0,), state_mixer="mamba2", conv_kernel=4, conv_bias=True,
                      mamba=MambaConfig(H, p, G, n))
    m = Mamba2Mixer(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        m.dt_bias.normal_(0, 0.5)
        m.A_log.uniform_(-1, 1.5)
        m.D.normal_()
    return m


def reference(m: Mamba2Mixer, u, b, c, dt, start_state: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence's rows, token by token: outputs and the state after each."""
    A, P, N = -torch.exp(m.A_log), m.m.head_dim, m.m.state_size
    s, ys, states = start_state.clone(), [], []
    for i in range(u.shape[0]):
        d = torch.nn.functional.softplus(dt[i] + m.dt_bias)                          # [H]
        bi = b[i].view(G, N).repeat_interleave(H // G, 0)                             # [H, N]
        ci = c[i].view(G, N).repeat_interleave(H // G, 0)
        x = u[i].view(H, P)
        s = torch.exp(d * A)[:, None, None] * s + (d[:, None] * x)[..., None] * bi[:, None, :]
        ys.append(((s * ci[:, None, :]).sum(-1) + m.D[:, None] * x).reshape(-1))
        states.append(s.clone())
    return torch.stack(ys), states


def step_of(chunks: list[tuple[int, int]], block: int = B) -> tuple[list[list[int]], list[int], int, object]:
    """A step of these chunks (start, end positions), each sequence's blocks 10 i .. of `block`
    positions: (tables, each chunk's first row, rows, the scan's StateStep); a step of one-row
    chunks has no segments."""
    tables = [[10 * i + j for j in range(8)] for i in range(len(chunks))]
    q_starts = [0]
    for s0, e in chunks:
        q_starts.append(q_starts[-1] + e - s0)
    meta, = state_steps([tables], [e for _, e in chunks], q_starts, q_starts[-1], block, 4, "cpu", scan=True)
    assert (meta.segments is None) == all(e - s0 == 1 for s0, e in chunks)
    return tables, q_starts, q_starts[-1], meta


# state sizes the kernel's recurrence holds in registers (16, 128), one it runs row by row (48), and
# head sizes its chunked form runs (a multiple of 16), on blocks that cut segments short (16) and
# blocks past its 64-row segments (128)
@pytest.mark.parametrize("p, n, block", [(P, N, B), (6, 128, B), (8, 48, B), (16, 32, B), (64, 128, B), (32, 64, 128),
                                         (16, 256, 128)],
                         ids=["16", "128", "48", "chunked-32", "chunked-128", "chunked-64-long", "chunked-256-long"])
@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "compiled"])
@pytest.mark.parametrize("chunks", [
    [(0, 70), (37, 41), (20, 21), (16, 16 + 80)],   # fresh over blocks and segments; from a state; a decode
    [(5, 6), (31, 32), (0, 1)],                     # a decode step: one offset
])
def test_both_forms_equal_the_recurrence(chunks, compiled, p, n, block):
    m = mixer(p, n)
    tables, q_starts, t, meta = step_of(chunks, block)
    torch.manual_seed(2)
    u, b, c, dt = torch.randn(t, H * p), torch.randn(t, G * n), torch.randn(t, G * n), torch.randn(t, H)
    states = torch.randn(BLOCKS * 10, H, p, n) * 0.3
    before = states.clone()
    with torch.no_grad():
        kernels = None
        if compiled:
            from pagedllm.kernels import load_ops

            kernels = load_ops()
        y = m.scan(u, b, c, dt, states, meta, kernels)
        for i, (s0, e) in enumerate(chunks):
            r = slice(q_starts[i], q_starts[i + 1])
            start = before[tables[i][(s0 - 1) // block]] if s0 else torch.zeros(H, p, n)
            want, after = reference(m, u[r], b[r], c[r], dt[r], start)
            torch.testing.assert_close(y[r], want, atol=2e-4, rtol=2e-4)
            for k, pos in enumerate(range(s0, e)):
                if pos % block == block - 1 or pos == e - 1:   # a block end or the chunk's end: its state is kept
                    torch.testing.assert_close(states[tables[i][pos // block]], after[k], atol=2e-4, rtol=2e-4)
