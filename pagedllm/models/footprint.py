"""What a loaded model's weights hold in memory, and what one token reads of them.

Resident: every weight tensor the model keeps (float parameters, quantized blocks and scales,
weights reordered for oneDNN), each storage once (a tied head shares the embedding's). A
mixture of experts holds all its experts, but a token reads only its top k of each sparse
layer: the active bytes leave out the rest, as kv-calc's active parameter count does."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .moe import SparseMoE
from .rope import RotaryEmbedding


@dataclass(frozen=True)
class WeightBytes:
    resident: int   # every weight held
    active: int     # what one token reads (a mixture: its top k experts a layer)


def _tensors(mod: nn.Module):
    yield from mod.parameters(recurse=False)
    yield from mod.buffers(recurse=False)
    for name in ("packed", "panels"):   # prepack.py's reordered copy (an attribute, not a buffer)
        packed = getattr(mod, name, None)
        if isinstance(packed, torch.Tensor):
            yield packed


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # an opaque (mkldnn) tensor: its own storage
        return id(t)


def weight_bytes(model: nn.Module) -> WeightBytes:
    seen: set[int] = set()
    resident = idle = 0
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):   # position tables, not weights
            continue
        own = 0
        for t in _tensors(mod):
            if t is None or _key(t) in seen:
                continue
            seen.add(_key(t))
            own += t.numel() * t.element_size()
        resident += own
        if isinstance(mod, SparseMoE):   # its own tensors: the stacked experts (the router is a child)
            idle += own * (mod.num_experts - mod.top_k) // mod.num_experts
    return WeightBytes(resident, resident - idle)
