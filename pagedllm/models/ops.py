"""The ops of a layer (Ops), each on the compiled CPU kernels or in torch: every layer's matmuls,
norms, activations, RoPE and experts go through one object, so that how a model runs (quantized,
packed, batch-invariant, with adapters) is settled in one place at load."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch_invariant import invariant_linear
from .moe import ACT_IDS, experts_torch
from .norm import RMSNorm
from .prepack import argmax_ready, is_packed, packed_argmax, packed_linear
from .quantization import block_linear
from .rope import RotaryEmbedding, apply_rope
from .w8a8 import W8A8, w8a8_linear


class Ops:
    """The per-token pieces of a layer: the compiled CPU kernels (pagedllm.kernels) when
    given, plain torch otherwise (CUDA, or where the kernels cannot be built). Both
    compute the same thing; tests hold one against the other. All of them work row by
    row; only the linear layers need batch-invariant mode (batch_invariant.py) for a row's
    result not to depend on the others."""

    def __init__(self, kernels=None) -> None:
        self.k = kernels
        self.batch_invariant = False
        self.quant: str | None = None  # the linear layers hold quantized weights (quantization.py, w8a8.py)
        self.packed = False  # the float linear layers' weights are reordered, in panels or for oneDNN (prepack.py)
        self.lora = None  # the step's adapters (lora.batch.LoRAStep), set by the runner around a forward
        # W8A8 experts have a kernel where the library was built with VNNI (asked once, not every layer's step)
        self.w8a8_experts = kernels is not None and kernels.moe_can_w8a8()

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(layer, x)
        if self.lora is not None and hasattr(layer, "lora_name"):  # the step's adapters, on their rows
            out = self.lora.add(layer.lora_name, x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])).view(out.shape)
        return out

    def _linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        fmt = getattr(layer, "qformat", None) if self.quant is not None else None
        if fmt == W8A8:
            return w8a8_linear(layer, x, self.k)
        if fmt is not None:
            return block_linear(layer, x, self.k)
        if self.batch_invariant:
            return invariant_linear(layer, x, self.k)
        return packed_linear(layer, x, self.k) if self.packed and is_packed(layer) else layer(x)

    def argmax_ready(self, layer: nn.Linear) -> bool:
        """Whether argmax gives linear(layer, x)'s argmax from a kernel (the panels'): settled at load."""
        plain = self.quant is None or getattr(layer, "qformat", None) is None
        return plain and self.packed and not self.batch_invariant and argmax_ready(layer, self.k)

    def argmax(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
        """int64 [M]: the first index of each row's largest value of linear(layer, x), where a
        kernel finds it without writing the rows' outputs (the panels'); None where none does."""
        if self.lora is None and x.dtype == torch.bfloat16 and self.argmax_ready(layer):
            return packed_argmax(layer, x, self.k)
        return None

    def fused(self, x: torch.Tensor) -> bool:
        return self.k is not None and x.device.type == "cpu" and x.shape[-1] % 16 == 0

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if not self.fused(x):
            return norm(x)
        out = torch.empty_like(x)
        self.k.rms_norm(out, x, norm.weight, norm.eps)
        return out

    def head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """norm over the last dim of [T, H, D] heads (QK-norm); x may be a strided view of qkv."""
        t, h, d = x.shape
        if not self.fused(x):
            return norm(x)
        return self.norm(x.reshape(t * h, d).contiguous(), norm).view(t, h, d)  # one copy: rows contiguous

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        if not self.fused(x):
            residual = x + residual
            return norm(residual), residual
        self.k.add_rms_norm(x, residual, norm.weight, norm.eps)  # in place: both were ours to reuse
        return x, residual

    def experts(self, moe, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """A mixture of experts' output for x's rows (models/moe.py): the chosen experts over their
        rows, weighted; one compiled call on the CPU."""
        if self.fused(x) and x.dtype in (torch.bfloat16, torch.float32):
            out = torch.empty_like(x)
            act, where = ACT_IDS[moe.activation], (moe.first_expert, moe.num_experts)
            if moe.w8a8:
                if not self.w8a8_experts:   # no VNNI: the same arithmetic in torch
                    return experts_torch(moe, x, weights, experts, self.act_mul)
                self.k.moe_experts_w8a8(out, x.contiguous(), *moe.w8a8_args(), weights, experts, act, *where)
            elif moe.quantized:
                self.k.moe_experts_blocks(out, x.contiguous(), *moe.block_args(), weights, experts, act, *where,
                                          *moe.act_args())
            else:
                self.k.moe_experts(out, x.contiguous(), moe.w13, moe.w2, weights, experts, act, *where, moe.packed,
                                   *moe.act_args())
            return out
        return experts_torch(moe, x, weights, experts, self.act_mul)

    def act_mul(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """activation(gate) * up, of gate_up = [gate | up]: silu, or GELU's tanh form."""
        if not self.fused(gate_up) or gate_up.shape[-1] % 32:   # the kernel: each half a multiple of 16
            gate, up = gate_up.chunk(2, dim=-1)
            return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
        (self.k.silu_and_mul if activation == "silu" else self.k.gelu_tanh_and_mul)(out, gate_up)
        return out

    def rotary(self, rope: RotaryEmbedding | None, positions: torch.Tensor, dtype: torch.dtype):
        """A function rotating (q, k) for this step's positions, tables looked up once; over
        the first rope.dim dims of each head (partial rotary); None: no RoPE (NoPE layers)."""
        if rope is None:
            return lambda q, k: (q, k)
        if self.k is not None and positions.device.type == "cpu" and rope.dim % 32 == 0:
            def rotate(q, k):
                self.k.rope(q[..., :rope.dim], k[..., :rope.dim], positions, rope.cos, rope.sin)  # in place
                return q, k
            return rotate
        cos, sin = rope(positions, dtype)
        return lambda q, k: (apply_rope(q, cos, sin), apply_rope(k, cos, sin))
