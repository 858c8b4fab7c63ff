"""The step's LoRA passes in Triton (the GPU's twin of kernels/csrc/lora.cpp: lora_sgmv), reading
each adapter from its KV pool pages through the same cell tables, as element offsets from one
base tensor (a GPU's allocations share one address space, so any pool tensor serves):

  shrink   one program per row of the step: xa[i, :R] = x[row] . A^T, cell by cell of A's rows
  expand   one program per (row, cell of N): out[row, cell] += xa[i, :R] . B^T's cells there
           (a cell that is not stored, a fused matmul's other piece, adds nothing)

Segment s's rows are rows[starts[s]:starts[s + 1]]; R_s = 0 skips them. Sums in fp32.
On a machine without CUDA they run under Triton's interpreter, as the attention kernels do."""
from __future__ import annotations

import weakref

import torch

from ..attention import triton_kernels as tk

triton, tl = tk.triton, tk.tl


@triton.jit
def _shrink(x_ptr, xa_ptr, rows, segs, ranks, a_offs, base, K, CA, R_MAX, stride_x,
            W: tl.constexpr, BW: tl.constexpr, BR: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows + i)
    s = tl.load(segs + i)
    r = tl.load(ranks + s)
    j = tl.arange(0, BR)
    jm = j < r
    w = tl.arange(0, BW)
    acc = tl.zeros([BR], dtype=tl.float32)
    for c in range(0, CA):
        cols = c * W + w
        cm = (w < W) & (cols < K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cm, other=0.0).to(tl.float32)
        offs = tl.load(a_offs + (s * R_MAX + j) * CA + c, mask=jm, other=0)
        a = tl.load(base + offs[:, None] + w[None, :], mask=jm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(xa_ptr + i * BR + j, acc)


@triton.jit
def _expand(out_ptr, xa_ptr, rows, segs, ranks, bt_offs, bt_has, base, N, CB, R_MAX, stride_out,
            W: tl.constexpr, BW: tl.constexpr, BR: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(rows + i)
    s = tl.load(segs + i)
    r = tl.load(ranks + s)
    j = tl.arange(0, BR)
    w = tl.arange(0, BW)
    cols = c * W + w
    cm = (w < W) & (cols < N)
    at = (s * R_MAX + j) * CB + c
    has = (j < r) & (tl.load(bt_has + at, mask=j < r, other=0) != 0)
    offs = tl.load(bt_offs + at, mask=has, other=0)
    b = tl.load(base + offs[:, None] + w[None, :], mask=has[:, None] & cm[None, :], other=0.0).to(tl.float32)
    xa = tl.load(xa_ptr + i * BR + j)
    delta = tl.sum(xa[:, None] * b, axis=0)
    o = out_ptr + row * stride_out + cols
    tl.store(o, (tl.load(o, mask=cm, other=0.0).to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=cm)


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# A placed adapter's tables never change: each is turned into offsets (on the device) once, and
# forgotten with the table (its adapter evicted).
_OFFSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def offsets(tab: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cell table of addresses (0: not stored) as element offsets from `base`, and where it has
    cells (int8), both on base's device."""
    got = _OFFSETS.get(tab)
    if got is None or got[0] != base.data_ptr():
        has = tab != 0
        offs = torch.where(has, (tab - base.data_ptr()) // base.element_size(), 0)
        got = _OFFSETS[tab] = (base.data_ptr(), offs.to(base.device), has.to(base.device, torch.int8))
    return got[1], got[2]


def lora_sgmv(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, starts: list[int],
              a_tabs: list[torch.Tensor], bt_tabs: list[torch.Tensor], width: int, base: torch.Tensor) -> None:
    """out[rows[i]] += (x[rows[i]] A_s^T) B_s^T for row i of segment s, in place; the tables as
    kernels/csrc/lora.cpp takes them (addresses), `base` a tensor of the adapters' dtype in the
    same address space (a pool tensor)."""
    n, k, nn = rows.numel(), x.shape[1], out.shape[1]
    ranks = [t.shape[0] for t in a_tabs]
    if n == 0 or not any(ranks):
        return
    dev = out.device
    ca, cb, rmax = -(-k // width), -(-nn // width), max(ranks)
    a_offs = torch.zeros(len(ranks), rmax, ca, dtype=torch.long, device=dev)
    bt_offs = torch.zeros(len(ranks), rmax, cb, dtype=torch.long, device=dev)
    bt_has = torch.zeros(len(ranks), rmax, cb, dtype=torch.int8, device=dev)
    for s, (a, bt) in enumerate(zip(a_tabs, bt_tabs)):
        if a.shape[0]:
            a_offs[s, :a.shape[0]] = offsets(a, base)[0]
            bt_offs[s, :a.shape[0]], bt_has[s, :a.shape[0]] = offsets(bt, base)
    segs = torch.repeat_interleave(torch.arange(len(ranks)), torch.tensor([e - b for b, e in zip(starts, starts[1:])]))
    br = _p2(rmax)
    xa = torch.empty(n, br, dtype=torch.float32, device=dev)
    rows_d, segs_d, ranks_d = rows.to(dev), segs.to(dev), torch.tensor(ranks, device=dev)
    bw = _p2(width)
    _shrink[(n,)](x, xa, rows_d, segs_d, ranks_d, a_offs, base, k, ca, rmax, x.stride(0), W=width, BW=bw, BR=br)
    _expand[(n, cb)](out, xa, rows_d, segs_d, ranks_d, bt_offs, bt_has, base, nn, cb, rmax,
                     out.stride(0), W=width, BW=bw, BR=br)
