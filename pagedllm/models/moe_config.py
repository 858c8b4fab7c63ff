"""A mixture of experts' routing and shape, as config.py (or a family's own config reader, families/)
reads it and moe.py runs it. Plain data."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts (models/moe.py): a router scores E experts per token (softmax in
    fp32), the top k run, their weights renormalized to sum to 1 where norm_topk (Mixtral,
    Qwen3-MoE); a shared expert beside them, gated by a sigmoid (Qwen2-MoE), or always added
    (DeepSeek's, shared_gated False). DeepSeek's routers: sigmoid scores with a per-expert bias
    that only picks (scoring "sigmoid", choice_bias), top k within the best `topk_group` of
    `groups` groups of experts (a group's score: its best expert, or with a bias its best two),
    and the weights times routed_scaling. gpt-oss's: a router with a bias, experts with biases
    and its clamped SwiGLU (ModelConfig.activation "swiglu_oai", swiglu_alpha and swiglu_limit).
    Its softmax over the top k's logits is the softmax over all renormalized over the k
    (norm_topk): one router computes both."""
    num_experts: int
    top_k: int
    width: int                       # each expert's intermediate size
    norm_topk: bool
    shared_width: int = 0            # the shared expert's intermediate size (0: none)
    sparse_layers: tuple[bool, ...] = ()   # per layer: experts (True) or the dense MLP; empty: every layer
    # Expert parallelism (ModelConfig.shard): the experts split over this many ranks, each holding
    # num_experts / expert_ranks of them whole (1: every rank holds every expert, or a shard of each).
    expert_ranks: int = 1
    shared_gated: bool = True
    scoring: str = "softmax"         # or "sigmoid"
    choice_bias: bool = False        # the router's e_score_correction_bias, added to pick only
    groups: int = 1                  # group-limited routing: experts in this many groups...
    topk_group: int = 1              # ...of which the best this many may be picked from
    routed_scaling: float = 1.0
    router_bias: bool = False        # the router's own bias, added to the logits (gpt-oss)
    expert_bias: bool = False        # each expert's gate|up and down biases (gpt-oss)
    swiglu_alpha: float = 1.702      # "swiglu_oai": (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
    swiglu_limit: float = 7.0
    # The checkpoint holds the experts as blocks of this format (quantization.RAW_TYPES: gpt-oss's
    # "MXFP4"), never as float weights: the mixture is built without float stacks ("": float).
    blocks: str = ""

    @property
    def plain_router(self) -> bool:
        """Softmax over every expert, top k, no scaling: the compiled router's (moe_route)."""
        return self.scoring == "softmax" and self.groups == 1 and self.routed_scaling == 1.0 and not self.router_bias

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_ranks

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer] if self.sparse_layers else True
