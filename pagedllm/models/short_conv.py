"""A gated short convolution (LFM2's conv layers): in_proj splits into B, C and x; the causal
depthwise convolution of kernel K runs over B * x, and C gates its output before o_proj.

Its state is the last K - 1 inputs B * x of each sequence, kept in the KV pool's blocks of its
layer slot (state_step.py says which are read and written). All rows of a step are one flat
batch: each row gathers its K inputs from the step's own rows or its sequence's state."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .ops import Ops
from .state_step import StateStep, state_rows


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, k = cfg.hidden_size, cfg.conv_kernel
        self.hidden, self.kernel = h, k
        self.in_proj = nn.Linear(h, 3 * h, bias=cfg.conv_bias)
        self.conv = nn.Conv1d(h, h, k, groups=h, bias=cfg.conv_bias)   # holds the weights; run as taps below
        self.o_proj = nn.Linear(h, h, bias=cfg.conv_bias)

    def forward(self, x, ops: Ops, rotate, k_cache, v_cache, meta: StateStep):
        b, c, u = ops.linear(self.in_proj, x).chunk(3, dim=-1)
        u = b * u                                               # [T, H]: what the convolution reads
        states = state_rows(k_cache, meta.width, self.hidden)   # [num_blocks, K - 1, H]
        read = states[meta.read_blocks].reshape(-1, self.hidden)   # a copy: read before this step writes
        rows = torch.cat([u, read, u.new_zeros(1, self.hidden)])
        taps = rows[meta.taps]                                  # [T, K, H]: inputs at p - K + 1 .. p
        y = (taps * self.conv.weight.view(self.hidden, self.kernel).t()).sum(1)
        if self.conv.bias is not None:
            y = y + self.conv.bias
        if len(meta.write_blocks):
            states[meta.write_blocks] = rows[meta.write_rows]
        return ops.linear(self.o_proj, (c * y).contiguous())
