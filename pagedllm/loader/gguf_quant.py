"""A GGUF file's linear weights as blocks (`quantization="gguf"`), read straight from the
file, no dequantize-requantize: Q4_1 and Q8_0 as they are, Q4_0 as Q4_1 with m = -8 d, and
Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K as the file's bytes (RawBlocks: a Q4_K_M file
stays ~4.5-5 bits a weight in memory).

Names follow transformers' GGUF mapping (blk.N.attn_q -> model.layers.N.self_attn.q_proj
...). llama.cpp's converter permutes the rows of attn_q / attn_k for its RoPE layout in
Llama-architecture files (convert_hf_to_gguf.py, LlamaModel.permute); transformers' loader
undoes it and so do we: whole output rows move, so blocks stay intact. Other tensor types
(F16, F32, IQ-quants...) are left out with a note: those layers run on the float weights that
the conversion of the same file holds (model_files.py), which are their exact values. A mixture
of experts' ffn_{gate,up,down}_exps hold a layer's experts at once ([E, N, K]): read as blocks of
all E N rows, expert after expert (the model's experts run them in place, models/moe.py).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from ..models import ModelConfig
from ..models.quantization import GGUF_RUNNABLE, Q4_1, Q8_0, RAW_TYPES, Blocks, GGUFBlocks, RawBlocks
from ..models.registry import FAMILIES
from .gguf_layout import PERMUTED_QK, unpermute_rows
from .model_files import model_path, resolve_model_dir

_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_qkv": "self_attn.qkv_proj",
            # a mixture of experts': all experts of a layer in one tensor [E, N, K], and Qwen2-MoE's shared expert
            "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
            # LFM2's gated short convolutions' matmuls (our ShortConv's in_proj and o_proj)
            "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.o_proj"}
# Architectures whose files keep gate/up fused as our model fuses it: their ffn_up holds the gate's
# rows then the up's (HF's gate_up_proj).
_FUSED_UP = tuple(f.gguf.arch for f in FAMILIES.values() if f.gguf is not None and f.gguf.fused_up)
_BLOCK = re.compile(r"blk\.(\d+)\.([\w.]+)\.weight")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name of a GGUF tensor (None: not a matmul weight: norms, rope tables)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LINEARS:
        sub = "mlp.gate_up_proj" if m.group(2) == "ffn_up" and arch in _FUSED_UP else _LINEARS[m.group(2)]
        return f"model.layers.{m.group(1)}.{sub}.weight"
    return None


def _blocks(kind: str, raw: np.ndarray, n: int, k: int) -> Blocks | RawBlocks:
    """Blocks of one tensor from its raw bytes [N, K/32 * block bytes] (copied where they are the
    read-only memory map of the file; the block cache's arrays are fresh)."""
    if kind in RAW_TYPES:
        own = raw if raw.flags.writeable else np.array(raw)
        return RawBlocks(kind, torch.from_numpy(own.view(np.uint8).reshape(n, -1)))
    nblk = k // 32
    b = np.asarray(raw, dtype=np.uint8).reshape(n, nblk, -1)
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        return Blocks(Q8_0, torch.from_numpy(b[..., 2:34].copy().view(np.int8)), d)
    if kind == "Q4_1":
        m = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        nib = b[..., 4:20]
    else:  # Q4_0: w = d (q - 8)
        m = -8 * d
        nib = b[..., 2:18]
    # ggml's Q4 byte j: element j in the low nibble, element j + 16 in the high one.
    q = np.empty((n, nblk, 32), dtype=np.uint8)
    np.bitwise_and(nib, 15, out=q[..., :16])
    np.right_shift(nib, 4, out=q[..., 16:])
    return Blocks(Q4_1, torch.from_numpy(q), d, m)


RUNNABLE = GGUF_RUNNABLE


@dataclass(frozen=True)
class MatmulTensor:
    """A matmul weight of a GGUF file: its GGUF name and type, K (along a row), N (all the rows: a
    stack of experts' E N), and bytes."""
    name: str
    kind: str
    k: int
    n: int
    data: np.ndarray  # [N, row bytes] uint8 (or the float values of an unquantized type)


def _gguf_tensors(path: str) -> tuple[str, list[MatmulTensor]]:
    """The file's architecture and matmul tensors. GGUFReader parses every metadata field, the
    tokenizer's strings and merges too: 13 s for Gemma 3's 262k-token vocabulary. So the bytes of
    the matmul tensors that run as blocks are kept once beside the file's conversion
    (model_files.py, keyed by the file's hash) and read from there after. Nothing is kept in the
    process: the model's blocks hold what they need, and a cache of these arrays kept Gemma's
    178 MB Q8_0 head alive a second time beside its split copy."""
    cache = resolve_model_dir(path) / "gguf" / "matmuls.safetensors"  # not beside the weights: their loader globs
    if cache.is_file():
        with safe_open(str(cache), framework="numpy") as f:
            meta = json.loads(f.metadata()["tensors"])
            return f.metadata()["arch"], [MatmulTensor(name, kind, k, n, f.get_tensor(name))
                                          for name, kind, k, n in meta]
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields.get("general.architecture")
    arch = arch.contents() if arch is not None else "llama"
    tensors = [MatmulTensor(t.name, t.tensor_type.name, int(t.shape[0]), int(np.prod(t.shape[1:])), t.data)  # ne0 (K) first
               for t in reader.tensors if hf_name(t.name) is not None]
    meta = json.dumps([(t.name, t.kind, t.k, t.n) for t in tensors])
    cache.parent.mkdir(exist_ok=True)
    tmp = cache.with_suffix(f".tmp-{os.getpid()}")
    kept = {t.name: np.ascontiguousarray(t.data) if t.kind in RUNNABLE else np.zeros(0, np.uint8) for t in tensors}
    save_file(kept, str(tmp), metadata={"arch": arch, "tensors": meta})
    os.replace(tmp, cache)  # whole or absent: a reader never sees half a file
    return arch, tensors


def read_gguf_blocks(path: str | Path, num_heads: int, num_kv_heads: int) -> GGUFBlocks:
    """HF-named matmul weights of the GGUF file at `path` as Blocks (attn_q / attn_k rows
    in HF's order), and a note for each matmul weight left out because its type has no
    kernel here ("blk.0.ffn_down.weight: Q6_K")."""
    blocks: dict[str, Blocks] = {}
    skipped: list[str] = []
    arch, tensors = _gguf_tensors(str(path))
    for t in tensors:
        name = hf_name(t.name, arch)
        if t.kind not in RUNNABLE:
            skipped.append(f"{t.name}: {t.kind}")
            continue
        n = t.n
        b = _blocks(t.kind, t.data, n, t.k)
        if arch in PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            b = b.rows(unpermute_rows(n, num_heads if ".q_proj." in name else num_kv_heads))
        blocks[name] = b
    return blocks, skipped


def model_gguf_blocks(model: str | None, mc: ModelConfig) -> GGUFBlocks:
    """The blocks of the GGUF file an engine was given (`model`; None: the default SmolLM2),
    for the model's quantize("gguf")."""
    return read_gguf_blocks(model_path(model), mc.num_heads, mc.num_kv_heads)
