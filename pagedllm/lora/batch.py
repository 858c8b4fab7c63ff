"""One step's adapters: for each matmul an adapter targets, the low-rank pass over that
adapter's rows, added to the base matmul's output. The base runs once for every row; no
weight is merged and the batch is not split by adapter (rows of the base model and of
several adapters share the step).

The step's adapter rows are put in adapter order once (`rows`, cut into segments); the compiled
kernel then runs every segment of a matmul in one call, reading each adapter from its pages."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged import PagedAdapter


@dataclass
class Segment:
    adapter: PagedAdapter
    start: int   # its rows are rows[start:end]
    end: int


class LoRAStep:
    """The step's adapters, each over its segment of rows, read from their KV pages by the
    compiled kernel (kernels/csrc/lora.cpp): one call a matmul, whatever the adapters."""

    def __init__(self, segments: list[Segment], rows: torch.Tensor, kernels, width: int,
                 base: torch.Tensor | None = None) -> None:
        """kernels: the compiled CPU kernels; None on a GPU, where the Triton twin runs
        (lora.triton_sgmv), its cell addresses read from `base` (a pool tensor)."""
        self.segments, self.rows, self.k, self.width, self.base = segments, rows, kernels, width, base
        self.starts = torch.tensor([0] + [s.end for s in segments])
        self.start_list = self.starts.tolist()   # the Triton path's
        self._none = torch.zeros(0, 1, dtype=torch.long)

    def add(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base matmul, [T, N]) plus each segment's adapter delta on its rows of `name`."""
        mods = [s.adapter.modules.get(name) for s in self.segments]
        if not any(mods):
            return out
        if not out.is_contiguous() or x.dtype != out.dtype:
            raise RuntimeError(f"lora: {name}'s output must be contiguous and of x's dtype")
        a_tabs, bt_tabs = [m.a_tab if m else self._none for m in mods], [m.bt_tab if m else self._none for m in mods]
        if self.k is not None:
            self.k.lora_sgmv(out, x.contiguous(), self.rows, self.starts, a_tabs, bt_tabs, self.width)
        else:
            from .triton_sgmv import lora_sgmv
            lora_sgmv(out, x.contiguous(), self.rows, self.start_list, a_tabs, bt_tabs, self.width, self.base)
        return out


def lora_step(rows: dict[int, list[int]], adapters: dict[int, PagedAdapter], kernels, width: int,
              base: torch.Tensor | None = None) -> LoRAStep | None:
    """The step of `rows` (adapter id -> its rows; id 0, the base model, needs nothing) over the
    placed `adapters`; `kernels`: the compiled CPU kernels (None: Triton's, reading from `base`);
    `width`: the pool's cell width W."""
    used = [(i, r) for i, r in sorted(rows.items()) if i and r]
    if not used:
        return None
    segments, order, n = [], [], 0
    for i, r in used:
        segments.append(Segment(adapters[i], n, n + len(r)))
        order.extend(r)
        n += len(r)
    return LoRAStep(segments, torch.tensor(order), kernels, width, base)


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
