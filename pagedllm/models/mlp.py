"""The dense MLP of a decoder layer: gate and up in one matmul, the activation, down (a mixture of
experts' shared expert is one too)."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int = 0) -> None:
        """width: its intermediate size (default the config's; a MoE's shared expert has its own)."""
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.activation = cfg.activation

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:   # ops: ops.Ops
        return ops.linear(self.down_proj, ops.act_mul(ops.linear(self.gate_up_proj, x), self.activation))
