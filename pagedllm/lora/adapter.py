"""PEFT LoRA adapters (a directory of adapter_config.json and adapter_model.safetensors) read
into the low-rank pieces of this model's matmuls.

PEFT names a piece by the checkpoint's module (`...layers.3.self_attn.q_proj.lora_A.weight`,
A [r, in], B [out, r]), read in our names through the family's renames (LFM2's
feed_forward.w1 is our mlp.gate_proj); our decoder fuses q/k/v into one matmul and gate/up into
another, so a piece lands on a column range of the fused output (LoRAPart.col). A checkpoint that
fused them itself (Phi-3's qkv_proj, gate_up_proj) has one piece over all of them, and so has a
state layer's own matmul (LFM2's conv.in_proj, Granite's mamba.in_proj / out_proj), whose B rows
follow the base weight's through the family's reorder. The delta a piece adds is
scaling * (x A^T) B^T with scaling = lora_alpha / r (rsLoRA: / sqrt(r)), as PEFT computes it
unmerged."""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import ModelConfig
from .layout import Piece
from .request import LoRARequest

# PEFT's module name -> (our matmul, which part of it: q, k, v / gate, up; None: all of it)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "qkv_proj": ("self_attn.qkv_proj", None),
           "o_proj": ("self_attn.o_proj", None), "gate_proj": ("mlp.gate_up_proj", 0),
           "up_proj": ("mlp.gate_up_proj", 1), "gate_up_proj": ("mlp.gate_up_proj", None),
           "down_proj": ("mlp.down_proj", None)}
_FUSED = {leaf: part for leaf, part in TARGETS.items() if part[1] is not None}   # q/k/v, gate/up
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.([\w.]+)\.lora_([AB])\.weight")
# adapter_config.json settings this engine does not compute, and why a user would see them
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained layers)",
            "fan_in_fan_out": "fan_in_fan_out (GPT-2-style Conv1D layers)", "rank_pattern": "rank_pattern",
            "alpha_pattern": "alpha_pattern"}


# The largest lora_alpha / r accepted: PEFT's adapters use 0.5-4 (alpha = r or 2r); past a few
# hundred the delta swamps the base layer and a bf16 B^T overflows to inf.
MAX_SCALING = 256.0


@dataclass
class LoRAPart:
    a: torch.Tensor   # [r, in]
    b: torch.Tensor   # [cols, r]
    col: int          # its first output column in our (fused) matmul


@dataclass
class LoRAModule:
    """An adapter's pieces on one of our matmuls: their A stacked [P r, in] (x A^T is one matmul
    whatever the number of pieces), and each piece's B transposed, scaling folded in, [r, width]
    at its first output column (rows in A's order). B^T of a fused matmul is block-diagonal:
    only the pieces are kept, not the zeros between them (lora.layout stores them so too)."""
    a: torch.Tensor                       # [P r, in]
    bt: list[tuple[int, torch.Tensor]]    # (first output column, [r, width]) per piece
    out_features: int                     # N: the matmul's output columns

    def dense_bt(self) -> torch.Tensor:
        """B^T whole, [P r, N], zeros off each piece's columns (the reference computation)."""
        out = self.a.new_zeros(self.a.shape[0], self.out_features)
        k = 0
        for col, bt in self.bt:
            out[k:k + bt.shape[0], col:col + bt.shape[1]] = bt
            k += bt.shape[0]
        return out

    def pieces(self) -> list[Piece]:
        return [Piece(bt.shape[0], self.a.shape[1], col, bt.shape[1]) for col, bt in self.bt]


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    modules: dict[str, LoRAModule]   # "layers.3.self_attn.qkv_proj" -> its pieces (scaling folded in)
    num_pages: int = 0               # KV pool pages it takes (lora.layout), set by the runner that pages it

    def layers(self) -> list[tuple[int, list[Piece]]]:
        """(layer, its pieces there) for every layer it adapts: what lora.layout counts."""
        by_layer: dict[int, list[Piece]] = {}
        for name, m in self.modules.items():
            by_layer.setdefault(int(name.split(".")[1]), []).extend(m.pieces())
        return sorted(by_layer.items())


def stack_parts(parts: list[LoRAPart], width: int, scaling: float) -> LoRAModule:
    """The pieces of one matmul (`width` output columns) as its LoRAModule."""
    a = torch.cat([p.a for p in parts]).contiguous()
    return LoRAModule(a, [(p.col, (p.b.T * scaling).contiguous()) for p in parts], width)


def layer_matmuls(mc: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each matmul of `layer` an adapter may reach, our names within
    the layer: attention's and the MLP's, or a state layer's mixer's and the MLP's."""
    mlp = {"mlp.gate_up_proj": (mc.hidden_size, 2 * mc.intermediate_size),
           "mlp.down_proj": (mc.intermediate_size, mc.hidden_size)}
    if layer in mc.state_layers:
        from ..models.layers import state_mixer_matmuls

        return {**state_mixer_matmuls(mc), **mlp}
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return {"self_attn.qkv_proj": (mc.hidden_size, q + 2 * kv), "self_attn.o_proj": (q, mc.hidden_size), **mlp}


def adapted_matmul(mc: ModelConfig, module: str, matmuls: dict[str, tuple[int, int]]) -> tuple[str, int | None] | None:
    """Where PEFT's `module` (the checkpoint's name within a layer whose matmuls are `matmuls`)
    lands: (our matmul within the layer, which of its fused parts or None for all of it); None
    where we hold no such matmul."""
    ours = mc.family.weights.name(module)
    head, _, leaf = ours.rpartition(".")
    if leaf in _FUSED and head == _FUSED[leaf][0].split(".")[0]:
        return _FUSED[leaf]
    return (ours, None) if ours in matmuls else None


def part_columns(mc: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """(first column, columns) of each part of our matmuls (q, k, v and gate, up where fused)."""
    q, kv, inter = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    return {"self_attn.qkv_proj": [(0, q), (q, kv), (q + kv, kv)], "self_attn.o_proj": [(0, mc.hidden_size)],
            "mlp.gate_up_proj": [(0, inter), (inter, inter)], "mlp.down_proj": [(0, mc.hidden_size)]}


def _rows_as_stored(mc: ModelConfig, layer: int, matmul: str, b: torch.Tensor, path: Path) -> torch.Tensor:
    """B [out, r] with its rows where the family's loader puts its base weight's (Qwen3-Next's
    DeltaNet in_proj rows regrouped): the delta's columns then line up with the base's."""
    reorder = mc.family.weights.reorder
    if reorder is None:
        return b
    name = f"layers.{layer}.{matmul}.weight"
    held = {name: b}
    reorder(held, mc)
    if set(held) != {name} or held[name].shape != b.shape:
        raise ValueError(f"lora: {path}: layer {layer} {matmul}'s weight is rearranged at load in a way an "
                         "adapter's rows cannot follow")
    return held[name]


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json; a setting we do not compute is refused by name."""
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"lora: {path} has no adapter_config.json (a PEFT LoRA adapter directory is expected)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"lora: {cfg_file} is not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"lora: {cfg_file} must hold a JSON object, not a {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora: {path} is a {cfg.get('peft_type')} adapter; only LORA is supported")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise ValueError(f"lora: {path} uses {what}, which is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"lora: {path} trains biases (bias={cfg['bias']!r}); only bias='none' is supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"lora: {path}: r must be a positive int, got {r!r}")
    if r > max_rank:
        raise ValueError(f"lora: {path} has rank {r}, above max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"lora: {path}: lora_alpha must be a finite number > 0, got {alpha!r}")
    scaling = float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    if scaling > MAX_SCALING:
        raise ValueError(f"lora: {path}: lora_alpha {alpha!r} over r {r} scales the adapter by {scaling:g}, above "
                         f"{MAX_SCALING:g} (PEFT's adapters use 0.5-4)")
    return r, scaling


# Tensor parallelism cuts an adapter as its base layer: column-parallel q/k/v and gate/up keep
# their B's rows for the rank's heads (or intermediate slice), row-parallel o/down their A's
# columns; the rank's partial delta of o/down joins the all-reduce of its partial output (the
# sum over ranks of (x_r A_r^T) B^T is (x A^T) B^T).
_COLUMN_PARALLEL, _ROW_PARALLEL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, {"o_proj", "down_proj"}


def _shard(name: str, ab: dict[str, torch.Tensor], rank: int, size: int, path: Path) -> dict[str, torch.Tensor]:
    """This rank's slice of one PEFT pair under tensor parallelism of `size`."""
    if size == 1:
        return ab
    if name in _COLUMN_PARALLEL:
        cut, dim = "B", 0
    elif name in _ROW_PARALLEL:
        cut, dim = "A", 1
    else:
        raise ValueError(f"lora: {path}: {name} is a matmul tensor parallelism does not cut as an adapter's "
                         "(q/k/v and gate/up are cut apart, o and down by their inputs; an adapter of those runs)")
    if cut in ab and ab[cut].shape[dim] % size:
        raise ValueError(f"lora: {path}: {name}'s lora_{cut} has {ab[cut].shape[dim]} along the cut, not a multiple "
                         f"of tensor_parallel_size {size}")
    return {**ab, cut: ab[cut].chunk(size, dim)[rank]} if cut in ab else ab


def load_adapter(req: LoRARequest, mc: ModelConfig, max_rank: int, dtype: torch.dtype,
                 tp: tuple[int, int] = (0, 1)) -> LoRAAdapter:
    """The adapter at req.lora_path for a model of config `mc` (under tensor parallelism tp =
    (rank, size): the rank's slice of the model, and of the adapter), its pieces in `dtype`.
    Raises ValueError naming what is wrong: a missing or corrupt file, a module we do not run, a
    shape that is not this base model's, a rank above max_rank."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(req.lora_path)
    rank, scaling = read_config(path, max_rank)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"lora: {path} has no adapter_model.safetensors (only safetensors adapters are read)")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"lora: {weights} cannot be read: {e}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    matmuls = functools.cache(functools.partial(layer_matmuls, mc))   # each adapted layer's, made once

    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        layer = int(m.group(1)) if m is not None else -1
        if m is not None and layer >= mc.num_layers:
            raise ValueError(f"lora: {path}: {key!r} is for layer {layer}; the base model has {mc.num_layers}")
        if m is None or adapted_matmul(mc, m.group(2), matmuls(layer)) is None:
            raise ValueError(f"lora: {path}: tensor {key!r} targets a module we do not adapt (supported: "
                             f"{', '.join(TARGETS)} of the decoder layers, and a state layer's own matmuls)")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"lora: {path}: tensor {key!r} must hold finite floats (it has "
                             f"{'NaN or Inf values' if t.is_floating_point() else t.dtype})")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    columns = part_columns(mc)
    pieces: dict[str, list[LoRAPart]] = {}
    for (layer, name), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora: {path}: layer {layer} {name} has lora_{''.join(ab)} without its pair")
        ab = _shard(name.rpartition(".")[2], ab, *tp, path)
        matmul, part = adapted_matmul(mc, name, matmuls(layer))
        k, n = matmuls(layer)[matmul]
        col, width = columns[matmul][part] if part is not None else (0, n)
        a, b = ab["A"], ab["B"]
        if part is None and matmul not in columns:   # a state layer's own matmul: B's rows as its weight's
            b = _rows_as_stored(mc, layer, matmul, b, path)
        want_a, want_b = (rank, k), (width, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"lora: {path}: layer {layer} {name} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                             f"this base model{' (one rank of tensor parallel)' if tp[1] > 1 else ''} needs "
                             f"A {want_a} and B {want_b} (an adapter of another model?)")
        pieces.setdefault(f"layers.{layer}.{matmul}", []).append(
            LoRAPart(a.float(), b.float(), col))
    if not pieces:
        raise ValueError(f"lora: {path} holds no LoRA weights")
    modules = {}
    for name, parts in pieces.items():
        layer, within = int(name.split(".")[1]), name.split(".", 2)[2]
        m = stack_parts(parts, matmuls(layer)[within][1], scaling)   # scaled in fp32, then rounded once
        module = LoRAModule(m.a.to(dtype), [(c, bt.to(dtype)) for c, bt in m.bt], m.out_features)
        if not all(bool(torch.isfinite(t).all()) for t in (module.a, *(bt for _, bt in module.bt))):
            raise ValueError(f"lora: {path}: {name}'s weights, scaled by {scaling:g}, overflow {dtype}")
        modules[name] = module
    return LoRAAdapter(req, rank, modules)
