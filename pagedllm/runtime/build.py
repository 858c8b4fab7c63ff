"""A model built for this rank: its layers on `device`, its slice of the weights loaded."""
from __future__ import annotations

from pathlib import Path

import torch

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..loader import load_weights
from ..models import DecoderForCausalLM, ModelConfig
from ..models.registry import decoder_for
from ..models.rope import RotaryEmbedding
from ..models.weights import expert_kept, tp_split_dim


def build_model(model_dir: Path, mc: ModelConfig, backend: AttentionBackend, kernels, tp: TPGroup,
                device: torch.device, dtype: torch.dtype, max_model_len: int | None = None) -> DecoderForCausalLM:
    """This rank's slice of the model, its weights loaded, in `dtype`, with its RoPE tables
    (float32 whatever the weights' dtype) for the positions an engine of `max_model_len` tokens
    uses: a model's own limit can be far larger (Gemma 3's 32,768 rows x 2 tables: 64 MiB)."""
    with torch.device("meta"):  # no random init of weights we overwrite anyway
        model = decoder_for(mc.model_type)(mc, backend, kernels, tp)
    materialize(model, device)
    if mc.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    ep = mc.moe is not None and mc.moe.expert_ranks > 1   # expert parallelism: this rank's experts, whole
    ours = mc.family.weights.name   # the split and the experts kept go by our names (Mixtral's w1 is gate_proj)
    experts = model.expert_range
    model.load_hf_weights(load_weights(model_dir, lambda n: tp_split_dim(ours(n), ep), tp.rank, tp.size,
                                       keep=(lambda n: expert_kept(ours(n), experts)) if ep else None))
    model = model.to(dtype).eval()
    rows = rope_rows(mc, max_model_len)
    model.ropes = [RotaryEmbedding(mc.rotary, rows, theta, scaling).to(device)
                   for theta, scaling in mc.ropes()]
    return model


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """A model built on the meta device given uninitialised tensors on `device`, in place (a tensor
    two modules share stays shared). Not nn.Module.to_empty: its empty_like of a meta tensor goes
    through torch's Python references, whose import pulls in sympy, 0.4 s of every engine's start."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = empty(t)


def rope_rows(mc: ModelConfig, max_model_len: int | None) -> int:
    """Positions the RoPE tables hold: the engine's limit, within the model's."""
    return mc.max_position_embeddings if max_model_len is None else min(mc.max_position_embeddings, max_model_len)
