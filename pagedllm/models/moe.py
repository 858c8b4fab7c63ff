"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral).

A router (one matmul to E scores) picks each token's top k experts; each expert is an MLP of
its own (gate and up, the activation, down); the token's output is the experts' outputs
weighted by their router probabilities (softmax in fp32, renormalized over the k where the
model says so). Qwen2-MoE adds a shared expert every token runs, gated by a sigmoid.

The experts' weights are stacked, w13 [E, 2I, H] (gate over up) and w2 [E, H, I], so a step's
rows are grouped by expert and each expert's matmuls run over its rows only: on the CPU in
one compiled call for the whole layer (kernels/csrc/moe.cpp: no Python loop over experts, and
an expert no row chose costs nothing); elsewhere the same grouping in torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .mlp import MLP


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.moe
        self.num_experts, self.top_k, self.norm_topk = m.num_experts, m.top_k, m.norm_topk
        self.gate = nn.Linear(cfg.hidden_size, m.num_experts, bias=False)   # the router
        self.w13 = nn.Parameter(torch.empty(m.num_experts, 2 * m.width, cfg.hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size, m.width), requires_grad=False)
        self.activation = cfg.activation
        if m.shared_width:
            self.shared_expert = MLP(cfg, m.shared_width)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k] int64) of each row, as transformers computes them."""
        probs = torch.softmax(ops.linear(self.gate, x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        weights, experts = self.route(x, ops)
        out = ops.experts(self, x, weights, experts)
        if hasattr(self, "shared_expert"):
            out += torch.sigmoid(ops.linear(self.shared_expert_gate, x)) * self.shared_expert(x, ops)
        return out


def experts_torch(moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  act_mul) -> torch.Tensor:
    """The experts over their rows in torch (where the compiled kernel does not run): rows
    grouped by expert once, a loop over the experts some row chose."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    rows = order // k
    out = torch.zeros_like(x, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        idx = rows[start:start + n]
        h = act_mul(F.linear(x[idx], moe.w13[e]), moe.activation)
        y = F.linear(h, moe.w2[e]).float() * weights.reshape(-1)[order[start:start + n]].unsqueeze(1)
        out.index_add_(0, idx, y)
        start += n
    return out.to(x.dtype)
