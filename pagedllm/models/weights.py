"""A checkpoint's tensors into a built decoder: the family's names mapped to ours (its WeightMapper),
q/k/v and gate/up fused into one matmul each, a mixture's experts stacked; and which dimension of
each tensor tensor parallelism cuts, and which experts a rank reads."""
from __future__ import annotations

import re

import torch
from torch import nn

from .config import ModelConfig
from .family import WeightMapper
from .quantization import RawBlocks

# Our fused matmuls (in a decoder layer) and the checkpoint's weights whose rows they
# concatenate, in order: HF names and the GGUF loader's both map through this.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")}

# Tensor parallelism: the HF weights split along which dimension. Column-parallel
# layers (q/k/v, gate/up) and the vocab-parallel embedding and LM head split their
# output rows, row-parallel o/down their input columns; whole heads stay on one rank
# because HF stores q/k/v head after head. Norms are replicated.
_SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
              "embed_tokens": 0, "lm_head": 0, "o_proj": 1, "down_proj": 1}


# A mixture's per-expert tensor (in our names: a family's own are mapped first).
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def stack_experts(loaded: dict[str, torch.Tensor], cfg: ModelConfig, experts: range | None = None) -> None:
    """A mixture of experts' per-expert tensors (layers.L.mlp.experts.E.gate_proj, in our names)
    stacked into each layer's w13 [E, 2I, H] and w2 [E, H, I], in place. `experts`: those this rank
    holds (expert parallelism; default all). ValueError naming an expert tensor that is missing."""
    if cfg.moe is None:
        return
    found: dict[tuple[int, int, str], torch.Tensor] = {}
    for name in [n for n in loaded if _EXPERT.fullmatch(n)]:
        layer, e, what = _EXPERT.fullmatch(name).groups()
        found[int(layer), int(e), what] = loaded.pop(name)
    # transformers 5 holds them stacked already (as its GGUF reader gives them): our layout, gate over up
    for name in [n for n in loaded if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        loaded[name.replace("experts.gate_up_proj", "w13").replace("experts.down_proj", "w2")] = loaded.pop(name)
    for layer in range(cfg.num_layers):
        if not cfg.moe.is_sparse(layer) or any(f"layers.{layer}.mlp.{w}" in loaded for w in ("w13", "w13_blocks")):
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


def load_hf_weights(model: nn.Module, weights: dict[str, torch.Tensor], mapper: WeightMapper,
                    experts: range | None = None) -> None:
    """Load HF-named tensors into `model` (a decoder over model.cfg), fusing q/k/v and gate/up into
    single matmuls; `experts`: those this rank holds. ValueError naming what does not match."""
    cfg: ModelConfig = model.cfg
    own = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        name = mapper.name(name)
        if mapper.norm_offset and name.endswith("norm.weight") and not name.endswith(mapper.plain_norms):
            # x * (offset + w): one weight to multiply
            t = t.float() + mapper.norm_offset
        loaded[name] = t
    if mapper.reorder is not None:
        mapper.reorder(loaded, cfg)
    stack_experts(loaded, cfg, experts)
    _set_expert_blocks(model, loaded)
    _fuse(loaded, cfg.num_layers)
    expected = {k for k in own if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    missing, unexpected = expected - loaded.keys(), loaded.keys() - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    with torch.no_grad():
        for name, t in loaded.items():
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(own[name].shape)}")
            own[name].copy_(t)


def _set_expert_blocks(model: nn.Module, loaded: dict) -> None:
    """Experts the checkpoint holds as blocks (layers.L.mlp.w13_blocks / w2_blocks: the bytes of
    MoEConfig.blocks' format, made by the family's reorder from gpt-oss's MXFP4) set on their
    mixtures, never float. ValueError where a layer has one and not the other."""
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}.mlp."
        have = [loaded.pop(p + n, None) for n in ("w13_blocks", "w2_blocks")]
        if any(b is not None for b in have):
            if any(b is None for b in have):
                raise ValueError(f"checkpoint holds layer {i}'s experts as blocks for one of gate_up / down only")
            layer.mlp.set_blocks(*(RawBlocks(model.cfg.moe.blocks, b) for b in have))


def _fuse(loaded: dict[str, torch.Tensor], num_layers: int) -> None:
    """Each layer's q/k/v and gate/up (a shared expert's too) as one tensor each, in place."""
    for i in range(num_layers):
        p = f"layers.{i}."
        for ours, theirs in FUSED.items():   # each fuses where its parts are (a layer has one MLP kind)
            for kind in ("weight", "bias"):
                names = [f"{p}{t}.{kind}" for t in theirs]
                if all(n in loaded for n in names):   # else left as they are (MLA's lone q_proj)
                    loaded[f"{p}{ours}.{kind}"] = torch.cat([loaded.pop(n) for n in names])
