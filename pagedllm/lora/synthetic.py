"""PEFT-format adapters of random weights on a model's real shapes: what a demo, a load test or a
benchmark of many adapters needs when what the adapters say does not matter, only their shapes,
ranks and number (the visualizer's lora scenario, the 500-adapter test, benchmarks/lora.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from ..models import ModelConfig
from .adapter import TARGETS, layer_matmuls, part_columns


def write_random_adapter(path: Path, mc: ModelConfig, seed: int, rank: int, targets: Sequence[str],
                         layers: Sequence[int] | None = None, std: float = 0.01,
                         dtype: torch.dtype = torch.float32) -> Path:
    """adapter_config.json and adapter_model.safetensors at `path`: rank `rank` on `targets` (PEFT's
    module names) of `layers` (default all), A and B drawn from N(0, std^2), lora_alpha = 2 rank."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    cols = part_columns(mc)
    tensors = {}
    for layer in range(mc.num_layers) if layers is None else layers:
        for t in targets:
            matmul, part = TARGETS[t]
            out = cols[matmul][part][1] if part is not None else sum(w for _, w in cols[matmul])
            key = f"base_model.model.model.layers.{layer}.{matmul.split('.')[0]}.{t}.lora_"
            tensors[key + "A.weight"] = (torch.randn(rank, layer_matmuls(mc, layer)[matmul][0], generator=g)
                                         * std).to(dtype)
            tensors[key + "B.weight"] = (torch.randn(out, rank, generator=g) * std).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(targets)}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
