"""RMSNorm: a layer's norms, and its q/k norms."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates in float32 for half types itself.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
