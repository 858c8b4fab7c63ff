"""One step's adapters: for each matmul an adapter targets, the low-rank pass over that
adapter's rows, added to the base matmul's output. The base runs once for every row; no
weight is merged and the batch is not split by adapter (rows of the base model and of
several adapters share the step).

The step's adapter rows are put in adapter order once (`perm`); a matmul then gathers its input's
rows once, runs each adapter's pair of matmuls on its contiguous segment, and adds the result
back into the base output's rows once: two ops a matmul plus two an adapter (a loop over
pieces and scattered rows cost half the throughput with 8 adapters)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapter import LoRAAdapter


@dataclass
class Segment:
    adapter: LoRAAdapter
    start: int   # its rows are perm[start:end]
    end: int


class LoRAStep:
    def __init__(self, segments: list[Segment], perm: torch.Tensor | None, kernels=None) -> None:
        self.segments = segments
        self.perm = perm   # None: every row of the step, in order, is the one segment's
        self.k = kernels
        if kernels is not None:   # the compiled pass (kernels/csrc/lora.cpp): rows and segments once a step
            n = segments[-1].end
            self.rows = torch.arange(n) if perm is None else perm
            self.starts = torch.tensor([0] + [s.end for s in segments])

    def add(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base matmul, [T, N]) plus each segment's adapter delta on its rows of `name`."""
        mods = [s.adapter.modules.get(name) for s in self.segments]
        if not any(mods):
            return out
        if self.k is not None and out.is_contiguous() and out.dtype in (torch.bfloat16, torch.float32) \
                and x.dtype == out.dtype:
            none_a, none_bt = x.new_empty(0, x.shape[1]), out.new_empty(0, out.shape[1])
            self.k.lora_sgmv(out, x.contiguous(), self.rows, self.starts, [m.a if m else none_a for m in mods],
                             [m.bt if m else none_bt for m in mods])
            return out
        if self.perm is None:   # one adapter on every row: straight into out
            out.addmm_(x @ mods[0].a.T, mods[0].bt)
            return out
        xs = x.index_select(0, self.perm)
        delta = out.new_zeros(xs.shape[0], out.shape[1])
        for s, m in zip(self.segments, mods):
            if m is not None:
                torch.mm(xs[s.start:s.end] @ m.a.T, m.bt, out=delta[s.start:s.end])
        out.index_add_(0, self.perm, delta)
        return out


def lora_step(rows: dict[int, list[int]], adapters: dict[int, LoRAAdapter], num_rows: int,
              device: torch.device, kernels=None) -> LoRAStep | None:
    """The step of `rows` (adapter id -> its rows; id 0, the base model, needs nothing);
    `kernels`: the compiled CPU kernels, where the step runs on them."""
    used = [(i, r) for i, r in sorted(rows.items()) if i and r]
    if not used:
        return None
    k = kernels if device.type == "cpu" else None
    if len(used) == 1 and len(used[0][1]) == num_rows:
        return LoRAStep([Segment(adapters[used[0][0]], 0, num_rows)], None, k)
    segments, order, n = [], [], 0
    for i, r in used:
        segments.append(Segment(adapters[i], n, n + len(r)))
        order.extend(r)
        n += len(r)
    return LoRAStep(segments, torch.tensor(order, device=device), k)


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
