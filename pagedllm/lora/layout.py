"""Where an adapter's weights lie in the KV pool's pages, and so how many pages it takes.
Plain Python: the memory manager asks for the count, the runner (lora.paged) writes and reads
the bytes.

A pool block is a row of each of the pool's 2S tensors (K and V of each of S layer slots,
kv.groups): 2S *slabs* of `slab` elements of the adapter's dtype. An adapter's matrices are cut
into *cells* of W elements: row j of A [R, in] is ceil(in / W) cells; row j of B^T [R, N]
only the cells its piece's columns [col, col + width) touch (a piece of a fused matmul, q or k
or v, is nonzero in its own columns only: the others are not stored). Layer l's cells go into
its own slot's slabs, cell after cell (layer, then module, then A's rows, then B^T's), a slab
holding floor(slab / W) of them. So, for an adapter over the layers l of each slot s:

    cells(l) = sum over its pieces p (rank r): r * (ceil(in_p / W) + n_W(col_p, width_p))
    n_W(c, w) = floor((c + w - 1) / W) - floor(c / W) + 1      (cells the columns touch)
    pages    = max over slots s of ceil(sum over l in s of cells(l) / (2 * floor(slab / W)))
    bytes    = pages * bytes_per_block                          (the pool's block, every layer)

W is fixed per model: the multiple of 16 dividing `slab` that wastes the fewest cells on the
model's matmul widths (SmolLM2: W = 192, which divides 576, 960, 1536 and 3072 exactly)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..util import cdiv

LANES = 16   # the kernel's vector: a cell is a whole number of them


@dataclass(frozen=True, slots=True)
class Piece:
    """One LoRA pair on part of a matmul: rank r, A [r, in], B [width, r] at output column col."""
    rank: int
    in_features: int
    col: int
    width: int


@dataclass(frozen=True, slots=True)
class PageGeometry:
    slab: int                         # elements of the adapter dtype in one slab (a block's row of one K or V tensor)
    width: int                        # W: elements in a cell
    slot_of_layer: tuple[int, ...]    # model layer -> its layer slot

    @property
    def cells_per_slab(self) -> int:
        return self.slab // self.width

    @property
    def cells_per_page(self) -> int:
        """Cells one page holds in each slot (its K row and its V row)."""
        return 2 * self.cells_per_slab

    def chunks(self, first_col: int, cols: int) -> range:
        """The cells (column chunks of W) that columns [first_col, first_col + cols) touch."""
        return range(first_col // self.width, (first_col + cols - 1) // self.width + 1)

    def piece_cells(self, p: Piece) -> int:
        return p.rank * (cdiv(p.in_features, self.width) + len(self.chunks(p.col, p.width)))

    def pages(self, layers: Iterable[tuple[int, Sequence[Piece]]]) -> int:
        """Pages of an adapter: (layer, its pieces on that layer) for every layer it adapts."""
        per_slot: dict[int, int] = {}
        for layer, pieces in layers:
            s = self.slot_of_layer[layer]
            per_slot[s] = per_slot.get(s, 0) + sum(self.piece_cells(p) for p in pieces)
        return max((cdiv(c, self.cells_per_page) for c in per_slot.values()), default=0)


def best_width(slab: int, dims: Iterable[int]) -> int:
    """W: a multiple of LANES dividing `slab` whose cells waste the fewest elements over `dims`
    (the model's matmul input and output widths); the widest among equals."""
    dims = sorted(set(dims))
    options = [w for w in range(LANES, slab + 1, LANES) if slab % w == 0]
    if not options:
        raise ValueError(f"lora: a KV slab of {slab} elements holds no {LANES}-element cell; "
                         "adapters cannot be paged in this pool (raise --block-size)")
    return min(options, key=lambda w: (sum(cdiv(d, w) * w - d for d in dims), -w))
