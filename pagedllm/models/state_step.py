"""A step's metadata for layers that keep a recurrent state in the KV pool (kv.groups' STATE
groups): which block each sequence's state is read from, which rows of the flat batch each
position's inputs are, and which blocks the step writes a state into.

A short convolution of kernel K (LFM2) keeps as its state the inputs of the last K - 1
positions. Block j of a sequence's state table holds that state after the last token written
in it (kv.groups): a chunk of positions c0..e-1 reads the state after c0 - 1, from block
(c0 - 1) // B, and writes the state after each position that ends a block, and after e - 1,
into that position's block. The index tensors are built once per step (the block ids once per
group), and every state layer uses them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
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
    fresh: torch.Tensor          # bool [S]: chunks that start at position 0 (their state starts at zero)
    # Every chunk one row (a decode step): chunk i is row i and writes its state into write_blocks[i].
    decode: bool
    # A step with a longer chunk, for a recurrence (scan=True): its chunks cut into segments.
    segments: Segments | None = None
    q_starts: torch.Tensor | None = None     # int64 [S + 1]: each chunk's first row (a recurrence run row by row)
    row_writes: torch.Tensor | None = None   # int64 [T]: the block each row's state is written into, -1 none


@dataclass(slots=True)
class Segments:
    """A step's chunks cut at block ends and every SEGMENT rows, each segment a padded row of
    rows [G, Q] (num_rows where padded): a recurrence runs within each at once (Mamba-2's chunked
    form) and from segment to segment of a chunk in order."""
    rows: torch.Tensor       # int64 [G, Q]
    valid: torch.Tensor      # bool [G, Q]
    chunk: torch.Tensor      # int64 [G]: the chunk each segment is of
    order: list[torch.Tensor]   # for k = 0, 1, ...: the segments that are the k-th of their chunks
    writes: torch.Tensor     # int64 [W]: segments that end a block or their chunk
    blocks: torch.Tensor     # int64 [W]: the block each of those writes its state into
    stores: torch.Tensor     # bool [G]: the segments in `writes`

    def as_stored(self, state: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The states segments `ids` leave ([len(ids), ...] float32), those a segment stores rounded
        to the pool's dtype as it is stored: the chunk goes on from the state a later chunk would
        read back (a prefix hit, a recompute after preemption), so both compute the same numbers."""
        if dtype == torch.float32:
            return state
        keep = self.stores[ids].view(-1, *([1] * (state.dim() - 1)))
        return torch.where(keep, state.to(dtype).float(), state)


SEGMENT = 64   # the most rows a segment runs at once (its [Q, Q] decay matrix per head)

Ref = tuple[int, int]   # (chunk, logical block): a block of that chunk's table


def state_steps(tables_by_group: Sequence[Sequence[Sequence[int]]], seq_lens: Sequence[int],
                q_starts: Sequence[int], num_rows: int, block_size: int, kernel: int, device: torch.device | str,
                scan: bool = False) -> list[StateStep]:
    """Each state group's metadata for a step whose chunk i is rows q_starts[i]..q_starts[i+1]-1,
    positions up to seq_lens[i] - 1, its state blocks tables[i] in the group's tables (RELEASED
    entries are never read here). What rows a position reads is the same for every group: it is
    built once, and only the block ids are each group's. scan: with the segments a recurrence
    (Mamba's) runs a prefill chunk in."""
    B, w = block_size, kernel - 1
    n = len(q_starts) - 1
    prev_base, zero = num_rows, num_rows + n * w
    taps = [[zero] * kernel for _ in range(num_rows)]
    reads: list[Ref | None] = []
    writes: list[Ref] = []
    write_rows = []
    writing_rows: list[int] = []   # the row each write follows
    for i in range(n):
        r0, r1, end = q_starts[i], q_starts[i + 1], seq_lens[i]
        c0 = end - (r1 - r0)
        reads.append((i, (c0 - 1) // B) if c0 else None)

        def row(q: int) -> int:   # the row holding position q's input (the zero row before position 0)
            if q >= c0:
                return r0 + q - c0
            return prev_base + i * w + q - c0 + w if q >= 0 else zero

        for p in range(c0, end):
            taps[r0 + p - c0] = [row(p - w + k) for k in range(kernel)]
            if p % B == B - 1 or p == end - 1:
                writes.append((i, p // B))
                write_rows.append([row(p - w + 1 + k) for k in range(w)])
                writing_rows.append(r0 + p - c0)

    def t(x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    fresh = torch.tensor([seq_lens[i] == q_starts[i + 1] - q_starts[i] for i in range(n)], device=device)
    decode = all(q_starts[i + 1] - q_starts[i] == 1 for i in range(n))
    taps_t, rows_t = t(taps).view(num_rows, kernel), t(write_rows).view(len(writes), w)
    segments, seg_writes = _segments(q_starts, seq_lens, B, num_rows, t) if scan and not decode else (None, [])
    starts, writing = (t(q_starts), t(writing_rows)) if scan else (None, None)
    out = []
    for tables in tables_by_group:
        def blocks(refs: Sequence[Ref]) -> torch.Tensor:
            return t([tables[i][j] for i, j in refs])

        written = blocks(writes)
        row_writes = None
        if scan:
            row_writes = torch.full((num_rows,), -1, dtype=torch.long, device=device)
            row_writes[writing] = written
        out.append(StateStep(t([tables[r[0]][r[1]] if r is not None else 0 for r in reads]), taps_t, written,
                             rows_t, num_rows, w, fresh, decode,
                             replace(segments, blocks=blocks(seg_writes)) if segments is not None else None,
                             starts, row_writes))
    return out


def _segments(q_starts, seq_lens, B: int, num_rows: int, t) -> tuple[Segments, list[Ref]]:
    """The segments, and the block each writing one writes into (Segments.blocks: each group's)."""
    n = len(q_starts) - 1
    q = min(SEGMENT, max(q_starts[i + 1] - q_starts[i] for i in range(n)))
    rows, chunk, order, writes, refs = [], [], [], [], []
    for i in range(n):
        r0, end = q_starts[i], seq_lens[i]
        c0 = end - (q_starts[i + 1] - r0)
        p, k = c0, 0
        while p < end:
            stop = min(end, (p // B + 1) * B, p + q)
            g = len(rows)
            rows.append([r0 + x - c0 for x in range(p, stop)] + [num_rows] * (q - (stop - p)))
            chunk.append(i)
            if k == len(order):
                order.append([])
            order[k].append(g)
            if stop % B == 0 or stop == end:
                writes.append(g)
                refs.append((i, (stop - 1) // B))
            p, k = stop, k + 1
    r = t(rows).view(len(rows), q)
    stores = torch.zeros(len(rows), dtype=torch.bool, device=r.device)
    stores[t(writes)] = True
    return Segments(r, r < num_rows, t(chunk), [t(o) for o in order], t(writes), t([]), stores), refs


def state_rows(pool: torch.Tensor, *shape: int) -> torch.Tensor:
    """A layer slot's K or V pool ([num_blocks, ...] in the backend's layout) as per-block states
    [num_blocks, *shape]: a state block's first prod(shape) values."""
    flat = pool.view(pool.shape[0], -1)
    size = math.prod(shape)
    if flat.shape[1] < size:
        raise ValueError(f"a state of {' x '.join(map(str, shape))} values does not fit a KV block's "
                         f"{flat.shape[1]}: raise block_size")
    return flat[:, :size].view(pool.shape[0], *shape)
