"""Causal depthwise convolutions over a step's flat batch, their state kept in the KV pool
(causal_conv); and LFM2's gated short convolution built on it (ShortConv): in_proj splits into B,
C and x; the convolution of kernel K runs over B * x, and C gates its output before o_proj.

A convolution's state is the last K - 1 inputs of each sequence, kept in the blocks of its
layer slot (state_step.py says which are read and written). All rows of a step are one flat
batch: each row gathers its K inputs from the step's own rows or its sequence's state."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .ops import Ops
from .state_step import StateStep, state_rows


def kernel_taps(conv: nn.Conv1d) -> tuple[torch.Tensor, torch.Tensor | None]:
    """conv's weight as the kernel reads it, float32 [K, D] (a tap a row), and its bias float32: made
    once for each version of the weights (converting them took a decode step's convolution longer
    than the convolution itself)."""
    key = (conv.weight.data_ptr(), conv.weight._version, conv.bias._version if conv.bias is not None else None)
    cached = getattr(conv, "_kernel_taps", None)
    if cached is None or cached[0] != key:
        d, k = conv.weight.shape[0], conv.weight.shape[-1]
        bias = conv.bias.detach().float().contiguous() if conv.bias is not None else None
        cached = conv._kernel_taps = (key, conv.weight.detach().view(d, k).t().float().contiguous(), bias)
    return cached[1], cached[2]


def causal_conv(u: torch.Tensor, conv: nn.Conv1d, pool: torch.Tensor, meta: StateStep, kernels=None,
                silu: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """conv (depthwise, kernel K, its bias if any) over inputs u [T, D] of the step's chunks, each
    continuing from the state its sequence's block holds, then SiLU if asked; the new states are
    written (into the first (K - 1) * D values of pool's blocks) after every block end and chunk
    end. On the CPU kernels (`kernels`; kernels/csrc/state_mixers.cpp) in one pass, u read in place
    (any row stride), the output in out_dtype (default u's)."""
    d, k = u.shape[1], conv.weight.shape[-1]
    states = state_rows(pool, meta.width, d)                  # [num_blocks, K - 1, D]
    if kernels is not None and d % 16 == 0 and u.stride(1) == 1 and states.dtype == u.dtype:
        y = torch.empty(u.shape[0], d, dtype=out_dtype or u.dtype, device=u.device)
        weight, bias = kernel_taps(conv)
        kernels.causal_conv(y, u, states, meta.read_blocks, weight, bias, meta.taps, silu, meta.write_blocks,
                            meta.write_rows)
        return y
    read = states[meta.read_blocks].reshape(-1, d)            # a copy: read before this step writes
    u = u.contiguous()
    rows = torch.cat([u, read, u.new_zeros(1, d)])
    y = (rows[meta.taps] * conv.weight.view(d, k).t()).sum(1)   # [T, K, D]: inputs at p - K + 1 .. p
    if conv.bias is not None:
        y = y + conv.bias
    if len(meta.write_blocks):
        states[meta.write_blocks] = rows[meta.write_rows]
    if silu:
        y = torch.nn.functional.silu(y)
    return y if out_dtype is None else y.to(out_dtype)


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, k = cfg.hidden_size, cfg.conv_kernel
        self.in_proj = nn.Linear(h, 3 * h, bias=cfg.conv_bias)
        self.conv = nn.Conv1d(h, h, k, groups=h, bias=cfg.conv_bias)   # holds the weights; run as taps
        self.o_proj = nn.Linear(h, h, bias=cfg.conv_bias)

    def forward(self, x, ops: Ops, rotate, k_cache, v_cache, meta: StateStep):
        b, c, u = ops.linear(self.in_proj, x).chunk(3, dim=-1)
        y = causal_conv(b * u, self.conv, k_cache, meta, ops.k if x.device.type == "cpu" else None)
        return ops.linear(self.o_proj, (c * y).contiguous())
