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

A hybrid model's recurrent layers (LFM2's short convolutions; Mamba's and DeltaNet's scans)
keep a state per sequence, not K/V per token. They get groups of their own kind, STATE (vLLM
v1's MambaManager), run by the same block tables as a sliding window of STATE_WINDOW = 2
tokens: block j of a sequence's table holds the state its layers had after the last of its
tokens written so far (after token (j+1)B - 1 once the block is full), and a query at p reads
the state that token p - 1 left, in block (p - 1) // B. So every older block is released as
the sequence moves on, yet stays in the prefix cache under its key until evicted: a later
prompt that shares the first k blocks restarts from block k - 1's state, the windowed group's
hit rule. The runner writes a snapshot into each block a step fills, and the last token's
state into the block it ends in; a block shared at fork is copied before that write, as a
partial K/V block is. A state block is the same bytes as a K/V block (the runner lays the
state out in the slot's K and V rows), so one pool serves both kinds.
Plain Python, no torch: the runner reads the layout to build its tensors, the manager to
keep one table per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from ..util import cdiv


KV, STATE = "kv", "state"   # what a group's blocks hold: K/V per token, or a recurrent state per sequence
STATE_WINDOW = 2            # a state group's window: a query at p reads what token p - 1 left


def group_kind(window: int, holds: str = KV) -> str:
    """A group's kind as the KV report and /metrics name it."""
    if holds == STATE:
        return "state"
    return f"sliding_window({window})" if window else "full"


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int                # W: a query at p reads keys p - W < j <= p; 0: every key (full attention)
    layers: tuple[int, ...]    # the model layers whose K/V (or state) this group's blocks hold, in tensor order
    holds: str = KV            # KV, or STATE (window STATE_WINDOW)

    @property
    def kind(self) -> str:
        return group_kind(self.window, self.holds)


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
    def kinds(self) -> tuple[str, ...]:
        """What each group's blocks hold (KV or STATE)."""
        return tuple(g.holds for g in self.groups)

    @property
    def has_state(self) -> bool:
        return STATE in self.kinds

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, tensor slot) of a model layer."""
        for gi, g in enumerate(self.groups):
            if layer in g.layers:
                return gi, g.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")


def kv_layout(layer_windows: Sequence[int], state_layers: Collection[int] = ()) -> KVLayout:
    """Groups for layers with these windows (0: full attention), and for `state_layers`, which
    keep a recurrent state (their windows are not read): full attention first (it serves the
    prefix cache's longest hits and the draft model's table), then windows from the
    narrowest, then state; each type's layers in order, g = the fewest layers of any type."""
    by_type: dict[tuple[str, int], list[int]] = {}
    for layer, w in enumerate(layer_windows):
        if w < 0:
            raise ValueError(f"layer {layer}: window {w} < 0")
        key = (STATE, STATE_WINDOW) if layer in state_layers else (KV, w)
        by_type.setdefault(key, []).append(layer)
    if not by_type:
        raise ValueError("a model needs at least one layer")
    if len(by_type) == 1:
        ((holds, w), layers), = by_type.items()
        return KVLayout((KVGroup(w, tuple(layers), holds),), len(layers))
    g = min(len(layers) for layers in by_type.values())
    groups = []
    for holds, w in sorted(by_type, key=lambda k: (k[0] == STATE, k[1])):
        layers = by_type[holds, w]
        groups += [KVGroup(w, tuple(layers[i:i + g]), holds) for i in range(0, len(layers), g)]
    return KVLayout(tuple(groups), g)


def merged(layer_windows: Sequence[int]) -> KVLayout:
    """One group for all layers: windowed by the widest window when every layer is windowed,
    else full (a sequence keeps every block). For what runs with one table per sequence
    (a draft model beside the target, CUDA graphs, reserve-max)."""
    windows = list(layer_windows)
    window = max(windows) if windows and 0 not in windows else 0
    return KVLayout.single(len(windows), window)


def engine_layout(layer_windows: Sequence[int], one_table: str | None = None,
                  draft_windows: Sequence[int] = (), state_layers: Collection[int] = ()) -> KVLayout:
    """An engine's layout: by attention type (windowed layers release their old blocks while
    full-attention ones keep theirs; recurrent layers keep a state), unless something reads the
    pool with one block table per sequence (`one_table` says what: a draft model beside the
    target, with `draft_windows`, reserve-max's one reservation). The second tier keeps each
    group's blocks under that group's keys (kv.tier_hit), so it needs no single table. Then one group, windowed only if every layer that reads it is; ValueError for
    a model with state layers, whose state cannot share a K/V table."""
    if one_table is None:
        return kv_layout(layer_windows, state_layers)
    if state_layers:
        raise ValueError(f"{one_table}, which a model whose layers keep a recurrent state (layers "
                         f"{sorted(state_layers)}) does not allow: its state has block tables of its own")
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
