"""The decoder every family here runs (registry.py): embeddings, decoder layers (layers.py), the
final norm and the LM head, over a flat token batch. The families differ by options of the layers
(family.Family): q/k biases or norms, partial rotary and the RoPE scalings, NoPE layers, per-layer
windows and RoPE bases, sandwich norms, scaled embeddings, a GELU gate, mixtures of experts.

All scheduled tokens of all sequences run as one [num_tokens, hidden] batch: no
padding in the linear layers. Only attention needs to know where sequences begin.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from .batch_invariant import ROW_TILE, pack_linears
from .config import ModelConfig
from .layers import DecoderLayer
from .moe import SparseMoE, interleave_experts, pack_experts
from .norm import RMSNorm
from .ops import Ops
from .prepack import prepack_linears, prepack_wanted
from .quantization import GGUFBlocks, choose_block_paths, embed_rows
from .quantize import quantize
from .rope import RotaryEmbedding
from .w8a8 import W8A8, pack_w8a8_linears
from .weights import load_hf_weights


@lru_cache(maxsize=8)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as transformers scales embeddings (sqrt(640) is 25.25 in bf16)."""
    return float(torch.tensor(value, dtype=dtype))


class DecoderForCausalLM(nn.Module):
    """A causal decoder-only language model: the class of every family registry.py lists with the
    shared decoder, which its config's options (cfg.family) shape; a family with layers of its own
    kind (nemotron_h.py) names their class in `layer`."""

    layer = DecoderLayer

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
        self.layers = nn.ModuleList(self.layer(cfg, backend, i) for i in range(cfg.num_layers))
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
        if self.cfg.embedding_multiplier != 1.0:
            x = x.mul_(self.cfg.embedding_multiplier)
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
        n += pack_experts(self, self.ops.k)   # bf16 experts, where packed runs faster here
        n += interleave_experts(self, self.ops.k)   # MXFP4 experts, for the int8 outer-product kernel
        choose_block_paths(self, self.ops.k)   # quantized blocks: the kernel, or dequantized where that wins
        # W8A8's int8 weights too; a tied head whose embedding was dropped keeps its rows to look up.
        return n + pack_w8a8_linears(self, {id(self.lm_head)} if self.embed_tokens.weight is None else set(), self.ops.k)

    def quantize(self, method: str, gguf: GGUFBlocks | None = None,
                 maxima: dict[str, torch.Tensor] | None = None) -> str:
        """The linear layers, experts and LM head quantized by `method` (quantize.py). Returns what
        runs how, for the log and describe()."""
        return quantize(self, method, gguf, maxima)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler upcasts only the rows it samples.
        Under tensor parallelism, this rank's slice of the vocabulary."""
        logits = self.ops.linear(self.lm_head, hidden)
        if self.cfg.logit_scale != 1.0:   # > 0: the argmax stays the head's (greedy_tokens)
            logits = logits.mul_(self.cfg.logit_scale)
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
        """Load HF-named tensors (the family's names, weights.py), fusing q/k/v and gate/up into single matmuls."""
        load_hf_weights(self, weights, self.cfg.family.weights, self.expert_range)
