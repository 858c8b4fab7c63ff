"""A step's metadata for layers that keep a recurrent state in the KV pool (kv.groups' STATE
groups): which block each sequence's state is read from, which rows of the flat batch each
position's inputs are, and which blocks the step writes a state into.

A short convolution of kernel K (LFM2) keeps as its state the inputs of the last K - 1
positions. Block j of a sequence's state table holds that state after the last token written
in it (kv.groups): a chunk of positions c0..e-1 reads the state after c0 - 1, from block
(c0 - 1) // B, and writes the state after each position that ends a block, and after e - 1,
into that position's block. The index tensors are built once per step and group, and every
state layer of the group uses them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(slots=True)
class StateStep:
    read_blocks: torch.Tensor    # int64 [S]: each chunk's block to read its state from (0 where none is read)
    taps: torch.Tensor           # int64 [T, K]: each row's K inputs, as rows of cat(new, read, zero)
    write_blocks: torch.Tensor   # int64 [W]: blocks a state is written into
    write_rows: torch.Tensor     # int64 [W, K - 1]: that state's inputs, as rows of the same
    num_rows: int                # T: rows of the step (padding included: theirs read zeros)
    width: int                   # K - 1: the positions a state holds


def state_step(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], q_starts: Sequence[int],
               num_rows: int, block_size: int, kernel: int, device: torch.device | str) -> StateStep:
    """The metadata of a step whose chunk i is rows q_starts[i]..q_starts[i+1]-1, positions up to
    seq_lens[i] - 1, its state blocks tables[i] (RELEASED entries are never read here)."""
    B, w = block_size, kernel - 1
    n = len(tables)
    prev_base, zero = num_rows, num_rows + n * w
    taps = [[zero] * kernel for _ in range(num_rows)]
    read, write_blocks, write_rows = [], [], []
    for i in range(n):
        r0, r1, end = q_starts[i], q_starts[i + 1], seq_lens[i]
        c0 = end - (r1 - r0)
        read.append(tables[i][(c0 - 1) // B] if c0 else 0)

        def row(q: int) -> int:   # the row holding position q's input (the zero row before position 0)
            if q >= c0:
                return r0 + q - c0
            return prev_base + i * w + q - c0 + w if q >= 0 else zero

        for p in range(c0, end):
            taps[r0 + p - c0] = [row(p - w + k) for k in range(kernel)]
            if p % B == B - 1 or p == end - 1:
                write_blocks.append(tables[i][p // B])
                write_rows.append([row(p - w + 1 + k) for k in range(w)])

    def t(x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return StateStep(t(read), t(taps).view(num_rows, kernel), t(write_blocks),
                     t(write_rows).view(len(write_blocks), w), num_rows, w)


def state_rows(pool: torch.Tensor, width: int, hidden: int) -> torch.Tensor:
    """A layer slot's pool (its K pool, [num_blocks, ...] in the backend's layout) as per-block
    states [num_blocks, width, hidden]: a state block's first width * hidden values."""
    flat = pool.view(pool.shape[0], -1)
    if flat.shape[1] < width * hidden:
        raise ValueError(f"a state of {width} x {hidden} values does not fit a KV block of {flat.shape[1]}: "
                         "raise block_size")
    return flat[:, :width * hidden].view(pool.shape[0], width, hidden)
