"""A built decoder's quantize step: what each method (config.QUANTIZATIONS) does to its linear layers,
its experts and its LM head, and a GGUF file's own blocks put in place of the float weights."""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from ..config import QUANTIZATIONS
from .moe import SparseMoE, quantize_experts
from .quantization import GGUF_RUNNABLE, GGUFBlocks, cat_rows, is_router, quantize_linears, set_blocks
from .smoothing import ALPHA, smooth
from .w8a8 import W8A8
from .w8a8 import quantize_linears as w8a8_linears
from .weights import FUSED

logger = logging.getLogger(__name__)


def quantize(model: nn.Module, method: str, gguf: GGUFBlocks | None = None,
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
    dtype = model.norm.weight.dtype
    tied = model.lm_head.weight is model.embed_tokens.weight
    if method == "gguf":
        if gguf is None:
            raise ValueError('quantization "gguf" needs the blocks of a GGUF file')
        done = load_gguf_blocks(model, gguf, dtype)
    elif method == W8A8:
        done, tied = _w8a8(model, dtype, maxima)
    else:
        done = _weight_only(model, method, dtype)
    if tied and getattr(model.lm_head, "qformat", None) is not None and not model.tp.distributed:
        model.embed_tokens.weight = None  # (a rank of tensor parallel keeps it: its lookup masks other ranks' ids)
    model.ops.quant, model.quant_summary = method, done
    return done


def _w8a8(model: nn.Module, dtype: torch.dtype, maxima: dict[str, torch.Tensor] | None) -> tuple[str, bool]:
    """W8A8 matmuls and experts, smoothed first where given the inputs' maxima; with whether the LM
    head is still tied to the embedding (smoothing gives the head its own weight)."""
    smoothed = smooth(model, maxima) if maxima is not None else 0
    tied = model.lm_head.weight is model.embed_tokens.weight
    n = w8a8_linears(model, dtype)
    done = f"{n} matmuls on int8 weights (per channel) and int8 activations (per token)" + \
        (f", {smoothed} smoothed (SmoothQuant, alpha {ALPHA})" if smoothed else "")
    moe = quantize_experts(model, W8A8)
    return done + (f"; the experts of {moe} layers W8A8 too, routers float" if moe else ""), tied


def _weight_only(model: nn.Module, method: str, dtype: torch.dtype) -> str:
    """int8 (q8_0 blocks) or int4 (q4_1, the LM head q8_0) weights from the float ones, experts too."""
    n = quantize_linears(model, method, dtype)
    done = f"{n - 1} matmuls on q4_1 blocks, the LM head on q8_0" if method == "int4" \
        else f"{n} matmuls on q8_0 blocks"
    moe = quantize_experts(model, method)
    if moe:
        done += f"; the experts of {moe} layers on {'q4_1' if method == 'int4' else 'q8_0'} blocks, routers float"
    return done


def load_gguf_blocks(model: nn.Module, gguf: GGUFBlocks, dtype: torch.dtype) -> str:
    """The GGUF file's own blocks for every linear layer whose parts are all of a type
    with a kernel; the rest keep their float weights (logged)."""
    blocks, skipped = gguf
    kinds: Counter[str] = Counter()
    floats = []
    experts = _load_gguf_experts(model, blocks, skipped)
    for name, layer in model.named_modules():
        if not isinstance(layer, nn.Linear) or is_router(name):
            continue
        if name == "lm_head":
            names = ["lm_head.weight" if "lm_head.weight" in blocks else "model.embed_tokens.weight"]
        else:  # layers.<i>.<matmul>: its checkpoint weights (several when fused, unless the file fused them)
            layers, i, sub = name.split(".", 2)
            whole = f"model.{layers}.{i}.{sub}.weight"
            parts = FUSED.get(sub, (sub,))
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


def _load_gguf_experts(model: nn.Module, blocks: dict, skipped: list[str]) -> str:
    """Each mixture's experts on the file's ffn_{gate,up,down}_exps blocks (for the log: what
    runs how). An expert type without a kernel fails naming the tensor; float ones (F16, BF16,
    F32) keep the conversion's exact values."""
    bad = [s for s in skipped if "_exps." in s and s.split(": ")[1] not in ("F32", "F16", "BF16")]
    if bad:
        raise ValueError(f"quantization 'gguf': expert tensors of a type without a kernel here: {', '.join(bad[:4])} "
                         f"(experts run {', '.join(GGUF_RUNNABLE)} blocks, or F16/BF16/F32 as floats)")
    kinds: set[str] = set()
    for i, layer in enumerate(model.layers):
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
