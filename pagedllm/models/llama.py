"""The decoder of every family here (SmolLM2, Llama 2/3, Mistral, Qwen2/3, SmolLM3, Phi-3/4,
Gemma 3) over a flat token batch. The families differ by options of the one layer below
(config.py: FAMILIES): q/k biases or norms, partial rotary and the RoPE scalings, NoPE layers,
per-layer windows and RoPE bases, Gemma's sandwich norms, scaled embeddings and GELU gate.

All scheduled tokens of all sequences run as one [num_tokens, hidden] batch: no
padding in the linear layers. Only attention needs to know where sequences begin.
"""
from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..config import QUANTIZATIONS
from ..distributed import TPGroup
from .batch_invariant import ROW_TILE, invariant_linear, pack_linears
from .config import ModelConfig
from .mlp import MLP
from .moe import SparseMoE, experts_torch, experts_verdict, quantize_experts
from .prepack import argmax_ready, is_packed, packed_argmax, packed_linear, prepack_linears, prepack_wanted
from .quantization import (GGUF_RUNNABLE, GGUFBlocks, block_linear, cat_rows, choose_block_paths, embed_rows, is_router,
                           quantize_linears, set_blocks)
from .rope import RotaryEmbedding, apply_rope
from .smoothing import ALPHA, smooth
from .w8a8 import W8A8, pack_w8a8_linears, w8a8_linear
from .w8a8 import quantize_linears as w8a8_linears

logger = logging.getLogger(__name__)
# Our fused matmuls (in a decoder layer) and the checkpoint's weights whose rows they
# concatenate, in order: HF names and the GGUF loader's both map through this.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates in float32 for half types itself.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


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
            silu, where = moe.activation == "silu", (moe.first_expert, moe.num_experts)
            if moe.w8a8:
                if not self.w8a8_experts:   # no VNNI: the same arithmetic in torch
                    return experts_torch(moe, x, weights, experts, self.act_mul)
                self.k.moe_experts_w8a8(out, x.contiguous(), *moe.w8a8_args(), weights, experts, silu, *where)
            elif moe.quantized:
                self.k.moe_experts_blocks(out, x.contiguous(), *moe.block_args(), weights, experts, silu, *where)
            else:
                self.k.moe_experts(out, x.contiguous(), moe.w13, moe.w2, weights, experts, silu, *where, moe.packed)
            return out
        return experts_torch(moe, x, weights, experts, self.act_mul)

    def act_mul(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """activation(gate) * up, of gate_up = [gate | up]: silu, or GELU's tanh form (Gemma)."""
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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, window: int = 0) -> None:
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.backend = backend
        self.scale = cfg.scale
        self.window = window  # this layer's sliding window (0: full attention)
        if cfg.family.qk_norm:  # over each head's d dims, before RoPE
            self.q_norm, self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps), RMSNorm(self.d, cfg.rms_norm_eps)
        elif cfg.family.qk_norm_whole:  # over all of q's heads at once (and k's), before RoPE
            self.q_norm = RMSNorm(self.h * self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kvh * self.d, cfg.rms_norm_eps)
        self.whole_norm = cfg.family.qk_norm_whole

    def forward(self, x, ops: Ops, rotate, k_cache, v_cache, meta: Any):
        t = x.shape[0]
        qkv = ops.linear(self.qkv_proj, x)
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        if self.whole_norm:
            q, k = ops.norm(q.contiguous(), self.q_norm), ops.norm(k.contiguous(), self.k_norm)
        q, k = q.view(t, self.h, self.d), k.view(t, self.kvh, self.d)
        if hasattr(self, "q_norm") and not self.whole_norm:
            q, k = ops.head_norm(q, self.q_norm), ops.head_norm(k, self.k_norm)
        q, k = rotate(q, k)
        o = self.backend.forward(q, k, v.view(t, self.kvh, self.d), k_cache, v_cache, meta, self.scale,
                                 window=self.window)
        return ops.linear(self.o_proj, o.reshape(t, self.h * self.d))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, cfg.window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the MLP's input norm
        self.mlp = SparseMoE(cfg) if cfg.moe is not None and cfg.moe.is_sparse(index) else MLP(cfg)
        if cfg.family.sandwich_norms:  # Gemma: each sublayer's output is normed before the residual add
            self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.family.sandwich_norms

    def forward(self, x, residual, ops: Ops, rotate, k_cache, v_cache, meta, tp: TPGroup):
        """x: the previous layer's output (not yet added to the residual stream), or the
        embeddings with residual None. Returns (this layer's output, residual stream).
        Under tensor parallelism o_proj and down_proj are row-parallel: each rank holds a
        partial sum of their output, made whole by one all-reduce each."""
        if residual is None:
            residual, x = x, ops.norm(x, self.input_layernorm)
        else:
            x, residual = ops.add_norm(x, residual, self.input_layernorm)
        x = tp.all_reduce(self.self_attn(x, ops, rotate, k_cache, v_cache, meta))
        if self.sandwich:
            x = ops.norm(x, self.attn_output_norm)
        x, residual = ops.add_norm(x, residual, self.post_attention_layernorm)
        x = tp.all_reduce(self.mlp(x, ops))
        return (ops.norm(x, self.mlp_output_norm) if self.sandwich else x), residual


# Tensor parallelism: the HF weights split along which dimension. Column-parallel
# layers (q/k/v, gate/up) and the vocab-parallel embedding and LM head split their
# output rows, row-parallel o/down their input columns; whole heads stay on one rank
# because HF stores q/k/v head after head. Norms are replicated.
_SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
              "embed_tokens": 0, "lm_head": 0, "o_proj": 1, "down_proj": 1}


_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def stack_experts(loaded: dict[str, torch.Tensor], cfg: ModelConfig, experts: range | None = None) -> None:
    """A mixture of experts' per-expert tensors (HF's layers.L.mlp.experts.E.gate_proj, Mixtral's
    block_sparse_moe.experts.E.w1/w3/w2 renamed so) stacked into each layer's w13 [E, 2I, H] and
    w2 [E, H, I], in place; the router (mlp.gate) under our name. `experts`: those this rank holds
    (expert parallelism; default all). ValueError naming an expert tensor that is missing."""
    if cfg.moe is None:
        return
    found: dict[tuple[int, int, str], torch.Tensor] = {}
    for name in [n for n in loaded if _EXPERT.fullmatch(n)]:
        layer, e, what = _EXPERT.fullmatch(name).groups()
        found[int(layer), int(e), what] = loaded.pop(name)
    for name in [n for n in loaded if n.endswith("block_sparse_moe.gate.weight")]:
        loaded[name.replace("block_sparse_moe", "mlp")] = loaded.pop(name)
    # transformers 5 holds them stacked already (as its GGUF reader gives them): our layout, gate over up
    for name in [n for n in loaded if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        loaded[name.replace("experts.gate_up_proj", "w13").replace("experts.down_proj", "w2")] = loaded.pop(name)
    for layer in range(cfg.num_layers):
        if not cfg.moe.is_sparse(layer) or f"layers.{layer}.mlp.w13" in loaded:
            continue
        parts = []
        for e in experts if experts is not None else range(cfg.moe.num_experts):
            for what in ("gate_proj", "up_proj", "down_proj"):
                if (layer, e, what) not in found:
                    raise ValueError(f"checkpoint lacks layers.{layer}.mlp.experts.{e}.{what}.weight "
                                     f"({cfg.model_type}: {cfg.moe.num_experts} experts a layer)")
            parts.append((torch.cat([found[layer, e, "gate_proj"], found[layer, e, "up_proj"]]),
                          found[layer, e, "down_proj"]))
        loaded[f"layers.{layer}.mlp.w13"] = torch.stack([a for a, _ in parts])
        loaded[f"layers.{layer}.mlp.w2"] = torch.stack([b for _, b in parts])


def tp_split_dim(name: str, expert_parallel: bool = False) -> int | None:
    """The dimension of HF tensor `name` that tensor parallelism cuts (None: every rank
    loads it whole). A mixture's experts are cut as the dense MLP's matmuls are (gate and up
    by rows, down by columns), or under expert parallelism kept whole (expert_kept picks a
    rank's); the router is replicated."""
    if expert_parallel and _EXPERT.search(name):
        return None
    parts = name.split(".")
    return _SPLIT_DIM.get(parts[-2]) if len(parts) >= 2 else None


def expert_kept(name: str, experts: range) -> bool:
    """Whether a rank holding `experts` reads tensor `name` (every tensor but other ranks' experts)."""
    m = _EXPERT.search(name)
    return m is None or int(m.group(2)) in experts


@lru_cache(maxsize=8)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as transformers scales Gemma's embeddings (sqrt(640) is 25.25 in bf16)."""
    return float(torch.tensor(value, dtype=dtype))


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint name in ours: its module's own name through the family's renames, once
    (Gemma's chain: its post_attention_layernorm is our attn_output_norm, and its
    pre_feedforward_layernorm our post_attention_layernorm)."""
    parts = name.split(".")  # ..., module, weight|bias
    if len(parts) >= 2:
        parts[-2] = dict(renames).get(parts[-2], parts[-2])
    return ".".join(parts)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, kernels=None, tp: TPGroup | None = None) -> None:
        """cfg: this rank's slice of the model (ModelConfig.shard) under tensor parallelism."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.ops = Ops(kernels)
        # An uninitialised table (_weight): the checkpoint fills it, and a random normal_ init would
        # cost a second of start-up on the meta device (it imports torch._dynamo).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        for moe in self.mixtures():   # expert parallelism: this rank's experts
            moe.first_expert = self.expert_range.start
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Not parameters: build_model computes the tables once the model is off the meta device
        # (cfg.ropes(): the global one, and the windowed layers' own where they have one).
        self.ropes: list[RotaryEmbedding] = []

    def mixtures(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    @property
    def expert_range(self) -> range:
        """The experts this rank holds (all of them but under expert parallelism)."""
        m = self.cfg.moe
        first = self.tp.rank * m.local_experts if m is not None and m.expert_ranks > 1 else 0
        return range(first, first + (m.local_experts if m is not None else 0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any,
                layer_meta: list[Any] | None = None) -> torch.Tensor:
        """kv_caches: each layer's K and V pools; meta: the attention backend's step metadata,
        or per layer in `layer_meta` (a model whose layer groups have block tables of their own)."""
        x = self.embed(input_ids)
        if self.cfg.family.embed_scale:
            x = x.mul_(_rounded(self.cfg.hidden_size ** 0.5, x.dtype))
        rotates = [self.ops.rotary(r, positions, x.dtype) for r in self.ropes]
        no_rope = self.ops.rotary(None, positions, x.dtype)
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            m = meta if layer_meta is None else layer_meta[i]
            r = self.cfg.rope_of(i)
            x, residual = layer(x, residual, self.ops, rotates[r] if r >= 0 else no_rope, k_cache, v_cache, m, self.tp)
        return self.ops.add_norm(x, residual, self.norm)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel: each rank looks up the ids in its own rows, zeros elsewhere,
        and an all-reduce adds the ranks' rows up."""
        if not self.tp.distributed:
            if self.embed_tokens.weight is None:  # tied to a quantized LM head: unpack the rows looked up
                return embed_rows(self.lm_head, input_ids)
            return self.embed_tokens(input_ids)
        local = input_ids - self.tp.rank * self.cfg.vocab_size
        outside = (local < 0) | (local >= self.cfg.vocab_size)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def make_batch_invariant(self) -> str:
        """Batch-invariant mode for the linear layers (once the weights are loaded and in
        their dtype): packs what the AMX matmul can run. Returns how they run, for the log."""
        self.ops.batch_invariant = True
        keep = {id(self.embed_tokens.weight)}  # a tied lm_head shares it: the embedding still needs it
        packed = pack_linears(self, self.ops.k, keep)
        linears = [m for m in self.modules() if isinstance(m, nn.Linear)]
        exact = sum(1 for m in linears if getattr(m, "qformat", None) == W8A8)
        total = len(linears) - exact
        if exact and not total:
            return f"{exact} W8A8 matmuls (exact int32 sums, scales per token)"
        if packed == total:
            return "AMX matmuls in a fixed order"
        if packed == 0:
            return f"matmuls on {ROW_TILE}-row tiles"
        return f"{packed} of {total} matmuls on AMX in a fixed order, the rest on {ROW_TILE}-row tiles"

    def prepack(self) -> int:
        """Reorders the float matmuls' weights, in panels for our bf16 kernel or for oneDNN
        (prepack.py), and W8A8's int8 ones (w8a8.py), once the weights are loaded, in their dtype, quantized and made
        batch-invariant (whose row tiles then run on them).
        A tied LM head's weight stays plain too: the embedding looks its rows up in it.
        Returns how many were reordered: none where the weights are not on a CPU oneDNN takes
        them on, or with PAGEDLLM_PREPACK=0."""
        if not prepack_wanted():
            return 0
        n = prepack_linears(self, {id(self.embed_tokens.weight)} if self.embed_tokens.weight is not None else set(),
                            self.ops.k, head=self.lm_head, single=self.ops.batch_invariant)
        self.ops.packed = n > 0
        if self.ops.k is not None and self.ops.k.moe_can_pack():   # bf16 experts: packed for vdpbf16ps (once, at load)
            for moe in self.mixtures():   # where the chooser times that faster than plain weights here
                if moe.can_pack() and moe.w13.device.type == "cpu" \
                        and experts_verdict(moe, self.ops.k).route.paths == ("panels",):
                    moe.pack_bf16()
                    n += 2
        choose_block_paths(self, self.ops.k)   # quantized blocks: the kernel, or dequantized where that wins
        # W8A8's int8 weights too; a tied head whose embedding was dropped keeps its rows to look up.
        return n + pack_w8a8_linears(self, {id(self.lm_head)} if self.embed_tokens.weight is None else set(), self.ops.k)

    def quantize(self, method: str, gguf: GGUFBlocks | None = None,
                 maxima: dict[str, torch.Tensor] | None = None) -> str:
        """Quantization of the linear layers and the LM head (once the weights are loaded
        and in their dtype): weight-only "int8" / "int4" from the float weights, "gguf" the
        blocks of a GGUF file as the loader read them (loader/gguf_quant.py); "w8a8" int8
        weights and activations (w8a8.py), smoothed first when given each matmul's input
        maxima (smoothing.py). A tied embedding then looks its rows up in the LM head's
        quantized weight (under w8a8 smoothing unties them: the embedding stays float).
        Returns what runs how, for the log and describe()."""
        if method not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
        dtype = self.norm.weight.dtype
        tied = self.lm_head.weight is self.embed_tokens.weight
        if method == "gguf":
            if gguf is None:
                raise ValueError('quantization "gguf" needs the blocks of a GGUF file')
            done = self._load_gguf_blocks(gguf, dtype)
        elif method == W8A8:
            smoothed = smooth(self, maxima) if maxima is not None else 0
            tied = self.lm_head.weight is self.embed_tokens.weight  # smoothing gives the head its own weight
            n = w8a8_linears(self, dtype)
            done = f"{n} matmuls on int8 weights (per channel) and int8 activations (per token)" + \
                (f", {smoothed} smoothed (SmoothQuant, alpha {ALPHA})" if smoothed else "")
            moe = quantize_experts(self, W8A8)
            if moe:
                done += f"; the experts of {moe} layers W8A8 too, routers float"
        else:
            n = quantize_linears(self, method, dtype)
            done = f"{n - 1} matmuls on q4_1 blocks, the LM head on q8_0" if method == "int4" \
                else f"{n} matmuls on q8_0 blocks"
            moe = quantize_experts(self, method)
            if moe:
                done += f"; the experts of {moe} layers on {'q4_1' if method == 'int4' else 'q8_0'} blocks, routers float"
        if tied and getattr(self.lm_head, "qformat", None) is not None and not self.tp.distributed:
            self.embed_tokens.weight = None  # (a rank of tensor parallel keeps it: its lookup masks other ranks' ids)
        self.ops.quant, self.quant_summary = method, done
        return done

    def _load_gguf_blocks(self, gguf: GGUFBlocks, dtype: torch.dtype) -> str:
        """The GGUF file's own blocks for every linear layer whose parts are all of a type
        with a kernel; the rest keep their float weights (logged)."""
        from collections import Counter

        blocks, skipped = gguf
        kinds: Counter[str] = Counter()
        floats = []
        experts = self._load_gguf_experts(blocks, skipped)
        for name, layer in self.named_modules():
            if not isinstance(layer, nn.Linear) or is_router(name):
                continue
            if name == "lm_head":
                names = ["lm_head.weight" if "lm_head.weight" in blocks else "model.embed_tokens.weight"]
            else:  # layers.<i>.<matmul>: its checkpoint weights (several when fused, unless the file fused them)
                layers, i, sub = name.split(".", 2)
                whole = f"model.{layers}.{i}.{sub}.weight"
                shared = sub.startswith("mlp.shared_expert.")   # Qwen2-MoE's: fused as the dense MLP is
                key = sub.replace("shared_expert.", "") if shared else sub
                parts = [t.replace("mlp.", "mlp.shared_expert.", 1) if shared else t for t in FUSED.get(key, (key,))]
                names = [whole] if whole in blocks else [f"model.{layers}.{i}.{t}.weight" for t in parts]
            have = [blocks.get(n) for n in names]
            if any(b is None for b in have):
                floats.append(name)
                continue
            try:
                fused = cat_rows(have) if len(have) > 1 else have[0]
            except ValueError:  # parts of formats with no common exact form (cat_rows)
                floats.append(name)
                continue
            set_blocks(layer, fused, dtype)
            kinds[fused.fmt] += 1
        if skipped or floats:
            logger.info(
                "gguf: %d matmuls keep float weights (tensor types without a kernel here: %s)",
                len(floats), ", ".join(skipped[:6]) + (" ..." if len(skipped) > 6 else ""))
        done = ", ".join(f"{n} on {k} blocks" for k, n in sorted(kinds.items()))
        return f"GGUF matmuls: {done}" + (f", {len(floats)} on {dtype} weights" if floats else "") + experts

    def _load_gguf_experts(self, blocks: dict, skipped: list[str]) -> str:
        """Each mixture's experts on the file's ffn_{gate,up,down}_exps blocks (for the log: what
        runs how). An expert type without a kernel fails naming the tensor; float ones (F16, BF16,
        F32) keep the conversion's exact values."""
        bad = [s for s in skipped if "_exps." in s and s.split(": ")[1] not in ("F32", "F16", "BF16")]
        if bad:
            raise ValueError(f"quantization 'gguf': expert tensors of a type without a kernel here: {', '.join(bad[:4])} "
                             f"(experts run {', '.join(GGUF_RUNNABLE)} blocks, or F16/BF16/F32 as floats)")
        kinds: set[str] = set()
        for i, layer in enumerate(self.layers):
            moe = layer.mlp
            if not isinstance(moe, SparseMoE):
                continue
            p = f"model.layers.{i}.mlp.experts."
            have = [blocks.get(f"{p}{w}_proj.weight") for w in ("gate", "up", "down")]
            if any(b is None for b in have):
                continue   # float experts in the file: the conversion's values
            e = moe.num_experts
            try:   # expert e's gate rows, then its up rows
                w13 = cat_rows([b.rows(torch.arange(j * b.shape[0] // e, (j + 1) * b.shape[0] // e))
                                for j in range(e) for b in have[:2]])
            except ValueError as err:
                raise ValueError(f"quantization 'gguf': layer {i}'s ffn_gate_exps ({have[0].fmt}) and ffn_up_exps "
                                 f"({have[1].fmt}) cannot run as one matmul: {err}") from None
            moe.set_blocks(w13, have[2])
            kinds.add(f"{w13.fmt}/{have[2].fmt}")
        return f"; experts on {', '.join(sorted(kinds))} blocks, routers float" if kinds else ""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler upcasts only the rows it samples.
        Under tensor parallelism, this rank's slice of the vocabulary."""
        logits = self.ops.linear(self.lm_head, hidden)
        cap = self.cfg.final_logit_softcap
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits

    def greedy_head(self) -> bool:
        """Whether greedy_tokens gives tokens (settled at load). A soft cap is monotone but can
        round two logits to one value, so capped logits keep the full head; so does a
        vocabulary split over ranks."""
        return not self.cfg.final_logit_softcap and not self.tp.distributed and self.ops.argmax_ready(self.lm_head)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """int64 [M]: argmax of compute_logits(hidden) a row (the first largest, as torch's),
        where the head's kernel gives it without writing the logits; None where it does not."""
        return self.ops.argmax(self.lm_head, hidden) if self.greedy_head() else None

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into single matmuls."""
        own = self.state_dict()
        loaded: dict[str, torch.Tensor] = {}
        fam = self.cfg.family
        for name, t in weights.items():
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            name = _rename(name, fam.renames)
            if fam.norm_offset and name.endswith("norm.weight"):  # Gemma's x * (1 + w): one weight to multiply
                t = t.float() + fam.norm_offset
            loaded[name] = t
        stack_experts(loaded, self.cfg, self.expert_range)
        for i in range(self.cfg.num_layers):
            p = f"layers.{i}."
            for ours, theirs in FUSED.items():
                if ours.startswith("mlp.") and f"{p}mlp.shared_expert.gate_proj.weight" in loaded:
                    ours, theirs = "mlp.shared_expert.gate_up_proj", ("mlp.shared_expert.gate_proj",
                                                                      "mlp.shared_expert.up_proj")
                for kind in ("weight", "bias"):
                    parts = [loaded.pop(f"{p}{t}.{kind}", None) for t in theirs]
                    if all(x is not None for x in parts):
                        loaded[f"{p}{ours}.{kind}"] = torch.cat(parts)
        expected = {k for k in own if not (k == "lm_head.weight" and self.cfg.tie_word_embeddings)}
        missing, unexpected = expected - loaded.keys(), loaded.keys() - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        with torch.no_grad():
            for name, t in loaded.items():
                if own[name].shape != t.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(own[name].shape)}")
                own[name].copy_(t)
