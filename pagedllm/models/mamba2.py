"""A Mamba-2 mixer (Granite 4.0-H's, Nemotron-H's, Falcon-H1's layers that keep a state): in_proj
gives the gate z, x B C and dt; x B C runs through a causal depthwise convolution and SiLU; then
the selective scan, per head h of head_dim values and a state [head_dim, state_size]:

    dt = clamp(softplus(dt + dt_bias)),  S = exp(dt * A) * S + dt * x B^T,  y = S C + D * x

(B and C shared by a group of heads), and a gated RMSNorm, norm(y * silu(z)), before out_proj.

Its state lives in the KV pool's blocks of its layer slot (kv.groups' STATE): the convolution's
last K - 1 inputs in the K rows, the scan's [heads, head_dim, state_size] in the V rows, read
from the block before each chunk and written after each block end and chunk end
(state_step.py). In float32: a decode step's one row a sequence as the recurrence itself, a step
with a prefill chunk in Mamba-2's chunked form over segments cut at block ends (Mamba2Mixer.chunked)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .ops import Ops
from .short_conv import causal_conv
from .state_step import StateStep, state_rows


class GatedRMSNorm(nn.Module):
    """norm(y * silu(gate)) * weight, the norm over each of `groups` equal groups of channels
    (Nemotron-H's, one a group of Mamba heads; Granite's: one group)."""

    def __init__(self, size: int, eps: float, groups: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.group = size // groups

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = (y.float() * F.silu(gate.float())).unflatten(-1, (-1, self.group))
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * y.to(gate.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = self.m = cfg.mamba
        self.in_proj = nn.Linear(cfg.hidden_size, m.inner + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, cfg.conv_kernel, groups=m.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GatedRMSNorm(m.inner, cfg.rms_norm_eps, m.norm_groups)
        self.out_proj = nn.Linear(m.inner, cfg.hidden_size, bias=m.proj_bias)

    def forward(self, x, ops: Ops, rotate, k_cache, v_cache, meta: StateStep):
        m = self.m
        z, xbc, dt = ops.linear(self.in_proj, x).split([m.inner, m.conv_dim, m.num_heads], dim=-1)
        kernels = ops.k if x.device.type == "cpu" and m.state_size % 16 == 0 else None
        # the CPU kernels: the convolution and SiLU in one pass, into the float32 the scan reads
        xbc = causal_conv(xbc, self.conv1d, k_cache, meta, kernels, silu=True,
                          out_dtype=torch.float32 if kernels is not None else None)
        u, b, c = xbc.split([m.inner, m.groups * m.state_size, m.groups * m.state_size], dim=-1)
        y = self.scan(u, b, c, dt, state_rows(v_cache, m.num_heads, m.head_dim, m.state_size), meta, kernels)
        if kernels is not None and self.norm.group % 16 == 0:
            out = torch.empty(x.shape[0], m.inner, dtype=x.dtype)
            kernels.gated_rms_norm(out, y, z, self.norm.weight, self.norm.eps, True, self.norm.group)
            return ops.linear(self.out_proj, out)
        return ops.linear(self.out_proj, self.norm(y.to(x.dtype), z).contiguous())

    def scan(self, u, b, c, dt, states: torch.Tensor, meta: StateStep, kernels=None) -> torch.Tensor:
        """The selective scan of the step's rows (u [T, inner], b and c [T, groups * N], dt [T, H])
        from each chunk's state in `states`; writes the states the step leaves. Returns y [T, inner]
        (float32 from the kernels, else u's dtype).
        On the CPU kernels (`kernels`, kernels/csrc/state_scans.cpp): a chunk of 16 rows or more in
        the chunked form on small matrix products, a shorter one row by row with each state in
        cache; else the torch forms below."""
        m, t, dtype = self.m, u.shape[0], u.dtype
        per_group = m.num_heads // m.groups
        if kernels is not None and meta.row_writes is not None:
            # u, b and c read in place from the convolution's float32 output, dt from in_proj's
            y = torch.empty(t, m.inner, dtype=torch.float32)   # float32: the gated norm reads it
            kernels.mamba_scan(y.view(t, m.num_heads, m.head_dim), u.float().view(t, m.num_heads, m.head_dim),
                               b.float().view(t, m.groups, m.state_size), c.float().view(t, m.groups, m.state_size), dt,
                               self.dt_bias, self.A_log, self.D, *m.dt_limit, states, meta.q_starts,
                               meta.read_blocks, meta.fresh, meta.row_writes)
            return y
        u = u.float().view(t, m.num_heads, m.head_dim)
        b = b.float().view(t, m.groups, 1, m.state_size).expand(-1, -1, per_group, -1).reshape(t, m.num_heads, 1, -1)
        c = c.float().view(t, m.groups, 1, m.state_size).expand(-1, -1, per_group, -1).reshape(t, m.num_heads, -1, 1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*m.dt_limit)        # [T, H]
        log_decay = dt * -torch.exp(self.A_log.float())                             # [T, H]
        s = states[meta.read_blocks].float()                                         # [S, H, P, N]
        if meta.fresh.any():
            s[meta.fresh] = 0
        if meta.segments is not None:   # a step with a prefill chunk: the chunked form
            y = self.chunked(u, b.squeeze(2), c.squeeze(-1), dt, log_decay, s, states, meta.segments)
        else:
            # A decode step: chunk i is row i. In place, one pass each over the [S, H, P, N] states:
            # such a step reads and writes every sequence's whole state, so it runs at memory speed.
            n = len(meta.read_blocks)
            y = torch.zeros_like(u)
            s.mul_(torch.exp(log_decay[:n])[..., None, None]).addcmul_((dt[:n, :, None] * u[:n])[..., None], b[:n])
            y[:n] = (s @ c[:n]).squeeze(-1)
            states[meta.write_blocks] = s.to(states.dtype)
        return (y + self.D.float()[:, None] * u).view(t, m.inner).to(dtype)

    @staticmethod
    def chunked(u, b, c, dt, log_decay, s, states: torch.Tensor, seg) -> torch.Tensor:
        """The scan in Mamba-2's chunked form (its state-space duality): within a segment of Q rows,
        y_t = sum_{r<=t} exp(A_t - A_r) (C_t . B_r) dt_r u_r, with A the running sum of log decays,
        plus exp(A_t) C_t . S_in; from segment to segment of a chunk S_out = exp(A_Q) S_in + the
        segment's own sum. u [T, H, P], b and c [T, H, N], dt and log_decay [T, H], s [S, H, P, N]
        (each chunk's state before it); writes the segments' states that end a block or chunk."""
        def rows(x):   # [T, ...] -> [G, Q, ...], zeros where padded
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[seg.rows]

        du, bs, cs, la = rows(dt[..., None] * u), rows(b), rows(c), rows(log_decay)     # [G, Q, H, .]
        acc = la.cumsum(1)                                                                 # [G, Q, H]
        a = acc.transpose(1, 2)                                                            # [G, H, Q]
        q = a.shape[-1]
        causal = torch.ones(q, q, dtype=torch.bool, device=u.device).tril()
        decay = torch.exp((a[..., :, None] - a[..., None, :]).masked_fill(~causal, float("-inf")))   # [G, H, Q, Q]
        y = torch.einsum("ghts,gshp->gthp", decay * torch.einsum("gthn,gshn->ghts", cs, bs), du)
        to_end = torch.exp(acc[:, -1:] - acc)                                              # [G, Q, H]
        own = torch.einsum("gshp,gshn->ghpn", du * to_end[..., None], bs)                  # [G, H, P, N]
        whole = torch.exp(acc[:, -1])                                                      # [G, H]
        s_in, s_out = torch.empty_like(own), torch.empty_like(own)
        for ids in seg.order:   # the k-th segments of their chunks, k = 0, 1, ...
            ch = seg.chunk[ids]
            s_in[ids] = s[ch]
            s[ch] = s_out[ids] = seg.as_stored(whole[ids][..., None, None] * s[ch] + own[ids], ids, states.dtype)
        y = y + torch.einsum("gthn,ghpn->gthp", cs, s_in) * torch.exp(acc)[..., None]
        if len(seg.writes):
            states[seg.blocks] = s_out[seg.writes].to(states.dtype)
        out = u.new_zeros(u.shape[0] + 1, *u.shape[1:])
        out[seg.rows[seg.valid]] = y[seg.valid]
        return out[:-1]
