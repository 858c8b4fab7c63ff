"""The KV cache's layer groups (vLLM v1's KV cache groups, its hybrid allocator).

A model whose layers attend differently (Gemma 3's five sliding-window layers to one
global, Qwen2's `max_window_layers`) needs different blocks kept per layer: a windowed
layer never reads a key older than its window, a full-attention layer reads them all. So
layers are split into groups of one attention type, each group with block tables of its
own, and every group draws its blocks from the one pool.

For one pool to serve every group, a block must be the same number of bytes whatever group
holds it: groups have the same number of layers, g (the fewest layers any one attention
type has), and a type with more layers gets several groups. The runner allocates g K/V
tensors of num_blocks blocks each; layer i of every group lives in tensor i, so block b
holds the g layers of whichever group owns it. A type whose layer count is not a multiple
of g has a last group with fewer layers: its blocks leave those tensor slots unused.

A model of one attention type has one group of all its layers: nothing changes for it.
Plain Python, no torch: the runner reads the layout to build its tensors, the manager to
keep one table per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..util import cdiv


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int                # W: a query at p reads keys p - W < j <= p; 0: every key (full attention)
    layers: tuple[int, ...]    # the model layers whose K/V this group's blocks hold, in tensor order

    @property
    def kind(self) -> str:
        return f"sliding_window({self.window})" if self.window else "full"


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    layers_per_block: int      # g: the layer slots every pool block has (one K/V tensor pair per slot)

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> KVLayout:
        """Every layer in one group (a model of one attention type, or groups merged)."""
        return cls((KVGroup(window, tuple(range(num_layers))),), num_layers)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, tensor slot) of a model layer."""
        for gi, g in enumerate(self.groups):
            if layer in g.layers:
                return gi, g.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")


def kv_layout(layer_windows: Sequence[int]) -> KVLayout:
    """Groups for layers with these windows (0: full attention): full attention first (it
    serves the prefix cache's longest hits and the draft model's table), then windows from
    the narrowest, each type's layers in order, g = the fewest layers of any type."""
    by_window: dict[int, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        if w < 0:
            raise ValueError(f"layer {layer}: window {w} < 0")
        by_window.setdefault(w, []).append(layer)
    if not by_window:
        raise ValueError("a model needs at least one layer")
    if len(by_window) == 1:
        (w, layers), = by_window.items()
        return KVLayout.single(len(layers), w)
    g = min(len(layers) for layers in by_window.values())
    groups = []
    for w in sorted(by_window):
        layers = by_window[w]
        groups += [KVGroup(w, tuple(layers[i:i + g])) for i in range(0, len(layers), g)]
    return KVLayout(tuple(groups), g)


def merged(layer_windows: Sequence[int]) -> KVLayout:
    """One group for all layers: windowed by the widest window when every layer is windowed,
    else full (a sequence keeps every block). For what runs with one table per sequence
    (a draft model beside the target, CUDA graphs, the disk tier, reserve-max)."""
    windows = list(layer_windows)
    window = max(windows) if windows and 0 not in windows else 0
    return KVLayout.single(len(windows), window)


def engine_layout(layer_windows: Sequence[int], one_table: str | None = None,
                  draft_windows: Sequence[int] = ()) -> KVLayout:
    """An engine's layout: by attention type (windowed layers release their old blocks while
    full-attention ones keep theirs), unless something reads the pool with one block table per
    sequence (`one_table` says what: a draft model beside the target, with `draft_windows`,
    the disk tier's one block per key, reserve-max's one reservation). Then one group,
    windowed only if every layer that reads it is."""
    if one_table is None:
        return kv_layout(layer_windows)
    one = merged(list(layer_windows) + list(draft_windows))
    return KVLayout.single(len(layer_windows), one.groups[0].window)


def held_blocks(layout_windows: Sequence[int], num_tokens: int, block_size: int, first_query: int | None = None) -> int:
    """The blocks one sequence of num_tokens tokens holds after a step whose first query was at
    `first_query` (default: the last token, a decode), over all groups:
        full group:   ceil(n / B)
        window W:     ceil(n / B) - max(0, q - W + 1) // B
    (a windowed group drops the blocks wholly below the window of its next queries)."""
    n, B = num_tokens, block_size
    q = n - 1 if first_query is None else first_query
    return sum(cdiv(n, B) - (max(0, q - w + 1) // B if w else 0) for w in layout_windows)
