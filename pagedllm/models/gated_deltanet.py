"""A gated DeltaNet mixer (Qwen3-Next's linear-attention layers): in_proj_qkvz gives q, k, v and the
output gate z, in_proj_ba the write strength b and the decay input a; q, k, v run through a causal
depthwise convolution and SiLU; then per value head, with q and k L2-normed (q scaled by k_dim^-0.5),
a state S [k_dim, v_dim] updated by the gated delta rule:

    g = -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b)
    S <- exp(g) S,  S <- S + k (beta (v - S^T k))^T,  o = S^T q

and a gated RMSNorm, norm(o) * w * silu(z), before out_proj.

Its state lives in the KV pool's blocks of its layer slot (kv.groups' STATE), as Mamba-2's does
(mamba2.py): the convolution's last K - 1 inputs in the K rows, S in the V rows, read before each
chunk and written at block and chunk ends (state_step.py). In float32: a decode step's row the
recurrence itself; a prefill chunk's segments (cut at block ends) in the chunked form: within a
segment the delta rule's updates solved at once as a triangular system (the WY form), from segment
to segment the state carried in order."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .ops import Ops
from .short_conv import causal_conv
from .state_step import StateStep, state_rows


class OutputGatedNorm(nn.Module):
    """RMSNorm of each head's output, times its weight, times silu(z) (Qwen3-Next's order: the
    norm first, the gate after)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        yf = y.float()
        normed = (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps)).to(y.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(y.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = self.m = cfg.deltanet
        # rows regrouped at load (families/qwen3_next.py): q, k, v, z of all heads; b, a of all heads
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, m.conv_dim + m.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * m.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, cfg.conv_kernel, groups=m.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(m.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_v_heads))
        self.norm = OutputGatedNorm(m.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(m.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x, ops: Ops, rotate, k_cache, v_cache, meta: StateStep):
        m, t = self.m, x.shape[0]
        qkv, z = ops.linear(self.in_proj_qkvz, x).split([m.conv_dim, m.value_dim], dim=-1)
        b, a = ops.linear(self.in_proj_ba, x).float().split([m.num_v_heads, m.num_v_heads], dim=-1)
        beta = torch.sigmoid(b).contiguous()                                                    # [T, H]
        g = (-torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())).contiguous()  # [T, H], log decay <= 0
        states = state_rows(v_cache, m.num_v_heads, m.k_dim, m.v_dim)
        if x.device.type == "cpu" and ops.k is not None and m.v_dim % 16 == 0 and meta.row_writes is not None:
            return self._compiled(x, qkv, z, beta, g, states, ops, k_cache, meta)
        qkv = F.silu(causal_conv(qkv, self.conv1d, k_cache, meta))
        q, k, v = qkv.float().split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        per = m.num_v_heads // m.num_k_heads
        q = l2norm(q.view(t, m.num_k_heads, m.k_dim)).repeat_interleave(per, dim=1) * m.k_dim ** -0.5
        k = l2norm(k.view(t, m.num_k_heads, m.k_dim)).repeat_interleave(per, dim=1)
        v = v.view(t, m.num_v_heads, m.v_dim)
        o = self.recur(q, k, v, beta, g, states, meta)
        y = self.norm(o.to(x.dtype), z.reshape(t, m.num_v_heads, m.v_dim))
        return ops.linear(self.out_proj, y.reshape(t, m.value_dim))

    def _compiled(self, x, qkv, z, beta, g, states, ops: Ops, k_cache, meta: StateStep):
        """The CPU kernels' path: the convolution and SiLU in one pass into float32, q, k and v read
        from it in place by the delta rule, which L2-norms q and k itself (and maps each value head
        to its key head), the gated norm in one pass."""
        m, t = self.m, x.shape[0]
        qkv = causal_conv(qkv, self.conv1d, k_cache, meta, ops.k, silu=True, out_dtype=torch.float32)
        q, k, v = qkv.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        o = torch.zeros(t, m.num_v_heads, m.v_dim)
        ops.k.delta_rule(o, q.view(t, m.num_k_heads, m.k_dim), k.view(t, m.num_k_heads, m.k_dim),
                         v.view(t, m.num_v_heads, m.v_dim), beta, g, states, meta.q_starts, meta.read_blocks,
                         meta.fresh, meta.row_writes, True, m.k_dim ** -0.5)
        y = torch.empty(t, m.value_dim, dtype=x.dtype)
        ops.k.gated_rms_norm(y, o.view(t, m.value_dim), z, self.norm.weight, self.norm.eps, False)
        return ops.linear(self.out_proj, y)

    @staticmethod
    def recur(q, k, v, beta, g, states: torch.Tensor, meta: StateStep) -> torch.Tensor:
        """The delta rule over the step's rows (q, k [T, H, Dk], v [T, H, Dv], beta and g [T, H]) from
        each chunk's state in `states`, in torch; writes the states the step leaves. Returns o [T,
        H, Dv]. (The CPU kernels run it row by row, each state in cache: kernels/csrc/state_scans.cpp.)"""
        s = states[meta.read_blocks].float()                                     # [S, H, Dk, Dv]
        if meta.fresh.any():
            s[meta.fresh] = 0
        if meta.segments is not None:   # a step with a prefill chunk: the chunked form
            return GatedDeltaNet.chunked(q, k, v, beta, g, s, states, meta.segments)
        # A decode step: chunk i is row i. S's decay folded into what reads it, so each state is
        # read once for both of its products (S^T q and S^T k, one batched matmul) and updated in
        # two passes (the decay, the rank-one write): such a step reads and writes every
        # sequence's whole state, and runs at the speed those passes go.
        n, h, dk, dv = s.shape
        o = torch.zeros_like(v)
        decay = torch.exp(g[:n])                                                   # [S, H]
        flat = s.view(n * h, dk, dv)
        read = torch.bmm(torch.stack([q[:n], k[:n]], dim=2).view(n * h, 2, dk), flat).view(n, h, 2, dv)
        delta = (v[:n] - decay[..., None] * read[:, :, 1]) * beta[:n, :, None]     # beta (v - (exp(g) S)^T k)
        o[:n] = decay[..., None] * read[:, :, 0] + (q[:n] * k[:n]).sum(-1, keepdim=True) * delta
        flat.mul_(decay.view(n * h, 1, 1)).baddbmm_(k[:n].reshape(n * h, dk, 1), delta.reshape(n * h, 1, dv))
        states[meta.write_blocks] = s.to(states.dtype)
        return o

    @staticmethod
    def chunked(q, k, v, beta, g, s, states: torch.Tensor, seg) -> torch.Tensor:
        """The delta rule in its chunked form over the step's segments of Q rows. Within a segment,
        with A the running sum of g and G_ij = exp(A_i - A_j) (j <= i), the updates u (S after row i
        = exp(A_i) S_in + sum_j<=i G_ij k_j u_j^T) solve (I + L) u = beta v - beta exp(A) k S_in,
        L_ij = beta_i G_ij k_i.k_j strictly below the diagonal: u = W - C S_in with W and C solved
        once for all segments. Then o = exp(A) q S_in + (q k^T * G, lower) u, and the state at the
        segment's end exp(A_Q) S_in + (exp(A_Q - A) k)^T u. Padded rows carry k = v = 0, beta = 0,
        g = 0: they change nothing. s [S, H, Dk, Dv]: each chunk's state before it."""
        def rows(x):   # [T, ...] -> [G, Q, ...] -> [G, H, Q, ...], zeros where padded
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[seg.rows].transpose(1, 2)

        qs, ks, vs, bs, gs = rows(q), rows(k), rows(v), rows(beta), rows(g)   # [G, H, Q, .], [G, H, Q]
        acc = gs.cumsum(-1)                                                    # [G, H, Q]
        nq = acc.shape[-1]
        lower = torch.ones(nq, nq, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((acc[..., :, None] - acc[..., None, :]).masked_fill(~lower, float("-inf")))   # G_ij
        kb = ks * bs[..., None]
        system = (kb @ ks.transpose(-1, -2)) * decay                          # unit diagonal taken as 1 below
        w = torch.linalg.solve_triangular(system, vs * bs[..., None], upper=False, unitriangular=True)
        c = torch.linalg.solve_triangular(system, kb * torch.exp(acc)[..., None], upper=False, unitriangular=True)
        intra = (qs @ ks.transpose(-1, -2)) * decay                           # [G, H, Q, Q]
        q_in = qs * torch.exp(acc)[..., None]                                 # reads S_in
        k_out = ks * torch.exp(acc[..., -1:] - acc)[..., None]                # writes the end state
        whole = torch.exp(acc[..., -1])[..., None, None]                      # [G, H, 1, 1]
        o = torch.empty_like(vs)
        s_out = torch.empty(len(seg.rows), *s.shape[1:], dtype=s.dtype, device=s.device)
        for ids in seg.order:   # the k-th segments of their chunks, k = 0, 1, ...
            ch = seg.chunk[ids]
            s_in = s[ch]
            u = w[ids] - c[ids] @ s_in
            o[ids] = q_in[ids] @ s_in + intra[ids] @ u
            s[ch] = s_out[ids] = seg.as_stored(whole[ids] * s_in + k_out[ids].transpose(-1, -2) @ u, ids, states.dtype)
        if len(seg.writes):
            states[seg.blocks] = s_out[seg.writes].to(states.dtype)
        out = v.new_zeros(v.shape[0] + 1, *v.shape[1:])
        out[seg.rows[seg.valid]] = o.transpose(1, 2)[seg.valid]
        return out[:-1]
