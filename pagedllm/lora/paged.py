"""Adapters written into the KV pool's pages and read from there (lora.layout says where): the
runner's half of kv.adapter_pages. A placed adapter is, per matmul, two tables of cell
addresses (A's rows and B^T's rows, cell by cell) that the compiled kernel reads through."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv import KVLayout
from ..models import ModelConfig
from ..util import cdiv
from .adapter import LoRAAdapter, layer_matmuls, part_columns
from .layout import PageGeometry, best_width


@dataclass
class PagedModule:
    a_tab: torch.Tensor    # int64 [R, ceil(in / W)]: the address of each cell of A's rows
    bt_tab: torch.Tensor   # int64 [R, ceil(N / W)]: of B^T's; 0 where a cell is not stored (all zeros)


@dataclass
class PagedAdapter:
    pages: list[int]
    modules: dict[str, PagedModule]


def matmul_widths(mc: ModelConfig) -> list[int]:
    """The input and output widths of the matmuls an adapter may target, and of their parts."""
    cols = part_columns(mc)
    # a state layer's own matmuls (every state layer has the same)
    own = {d for dims in layer_matmuls(mc, mc.state_layers[0]).values() for d in dims} if mc.state_layers else set()
    return [mc.hidden_size, mc.num_heads * mc.head_dim, mc.intermediate_size, *sorted(own),
            *(w for parts in cols.values() for _, w in parts), *(c for parts in cols.values() for c, _ in parts if c)]


class AdapterSlabs:
    """The pool's K and V tensors as slabs of the adapter dtype: one row of `slab` elements per
    block and tensor."""

    def __init__(self, pools: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout, mc: ModelConfig,
                 dtype: torch.dtype) -> None:
        for t in (t for pair in pools for t in pair):
            if not t.is_contiguous() or (t[0].numel() * t.element_size()) % dtype.itemsize:
                raise ValueError("lora: the KV pool's blocks are not whole rows of the adapter dtype; "
                                 "adapters cannot be paged in it")
        self.dtype = dtype
        self.views = [tuple(t.view(t.shape[0], -1).view(torch.uint8).view(dtype) for t in pair) for pair in pools]
        slab = self.views[0][0].shape[1]
        self.geometry = PageGeometry(slab, best_width(slab, matmul_widths(mc)),
                                     tuple(layout.place(i)[1] for i in range(mc.num_layers)))
        self.row_bytes = slab * dtype.itemsize
        self.bases = [torch.tensor([k.data_ptr(), v.data_ptr()]) for k, v in self.views]

    def pages(self, adapter: LoRAAdapter) -> int:
        return self.geometry.pages(adapter.layers())

    def place(self, adapter: LoRAAdapter, pages: list[int]) -> PagedAdapter:
        """Write the adapter's cells into `pages` (its blocks, in page order) and return the
        tables to read them through."""
        geo, W = self.geometry, self.geometry.width
        cells: dict[int, list[torch.Tensor]] = {}   # slot -> its cell rows [n, W], in order
        count: dict[int, int] = {}
        where: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        for name in sorted(adapter.modules, key=lambda n: (int(n.split(".")[1]), n)):
            m = adapter.modules[name]
            slot = geo.slot_of_layer[int(name.split(".")[1])]
            rows, k = m.a.shape
            ca, cb = cdiv(k, W), cdiv(m.out_features, W)
            n = count.get(slot, 0)
            parts = [torch.nn.functional.pad(m.a, (0, ca * W - k)).reshape(rows * ca, W)]
            a_idx = n + torch.arange(rows * ca).view(rows, ca)
            n += rows * ca
            bt_idx = torch.full((rows, cb), -1, dtype=torch.long)
            row = 0
            for col, bt in m.bt:
                r, width = bt.shape
                ch = geo.chunks(col, width)
                dense = bt.new_zeros(r, len(ch) * W)
                dense[:, col - ch.start * W:col - ch.start * W + width] = bt
                parts.append(dense.reshape(r * len(ch), W))
                bt_idx[row:row + r, ch.start:ch.stop] = n + torch.arange(r * len(ch)).view(r, len(ch))
                n, row = n + r * len(ch), row + r
            cells.setdefault(slot, []).extend(parts)
            count[slot] = n
            where[name] = (slot, a_idx, bt_idx)
        cpp, cps = geo.cells_per_page, geo.cells_per_slab
        for slot, parts in cells.items():
            data = torch.cat(parts).to(self.views[slot][0].device, self.dtype)
            used = cdiv(data.shape[0], cpp)
            buf = data.new_zeros(used * cpp, W)
            buf[:data.shape[0]] = data
            buf = buf.view(used, 2, cps * W)
            idx = torch.tensor(pages[:used], device=data.device)
            for kv in (0, 1):
                self.views[slot][kv][idx, :cps * W] = buf[:, kv]
        page_t = torch.tensor(pages, dtype=torch.long)

        def addresses(slot: int, idx: torch.Tensor) -> torch.Tensor:
            i = idx.clamp(min=0)
            rem = i % cpp
            addr = self.bases[slot][rem // cps] + page_t[i // cpp] * self.row_bytes + (rem % cps) * (W * self.dtype.itemsize)
            return torch.where(idx >= 0, addr, 0).contiguous()

        return PagedAdapter(list(pages), {name: PagedModule(addresses(s, a), addresses(s, b))
                                          for name, (s, a, b) in where.items()})
