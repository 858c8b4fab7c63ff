"""One step's adapters: for each matmul an adapter targets, the low-rank pass over that
adapter's rows, added to the base matmul's output. The base runs once for every row; no
weight is merged and the batch is not split by adapter (rows of the base model and of
several adapters share the step)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapter import LoRAAdapter


@dataclass
class Segment:
    adapter: LoRAAdapter
    rows: torch.Tensor | None   # the step's rows of this adapter (None: every row)


class LoRAStep:
    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments

    def add(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base matmul, [T, N]) plus each segment's adapter delta on its rows of `name`."""
        for seg in self.segments:
            parts = seg.adapter.modules.get(name)
            if not parts:
                continue
            xs = x if seg.rows is None else x.index_select(0, seg.rows)
            s = seg.adapter.scaling
            for p in parts:
                delta = (xs @ p.a.T) @ p.b.T
                view = out[:, p.col:p.col + p.b.shape[0]]
                if seg.rows is None:
                    view.add_(delta, alpha=s)
                else:
                    view.index_add_(0, seg.rows, delta, alpha=s)
        return out


def lora_step(rows: dict[int, list[int]], adapters: dict[int, LoRAAdapter], num_rows: int,
              device: torch.device) -> LoRAStep | None:
    """The step of `rows` (adapter id -> its rows; id 0, the base model, needs nothing)."""
    segments = [Segment(adapters[i], None if len(r) == num_rows else torch.tensor(r, device=device))
                for i, r in sorted(rows.items()) if i and r]
    return LoRAStep(segments) if segments else None


def name_lora_layers(model: torch.nn.Module) -> int:
    """Tag each decoder-layer matmul with its name ("layers.3.self_attn.qkv_proj"): Ops.linear
    adds the step's adapters to a tagged layer's output. Returns how many were tagged."""
    n = 0
    for name, layer in model.named_modules():
        parts = name.split(".")
        if isinstance(layer, torch.nn.Linear) and len(parts) == 4 and parts[0] == "layers":
            layer.lora_name = name
            n += 1
    return n
