"""lora_sgmv (kernels/csrc/lora.cpp), the step's low-rank passes over their rows in one call a
matmul, reading each adapter through tables of cell addresses, against torch: segments of
several adapters, one without this matmul (R = 0), B^T cells left out (a fused matmul's other
pieces), row counts that leave a short group of 4, K and N with tails past a cell and a vector;
and an adapter written into pool pages by lora.paged, read back through its tables."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_ops
from pagedllm.kv import KVLayout
from pagedllm.lora.adapter import LoRAAdapter, LoRAModule
from pagedllm.lora.batch import lora_step
from pagedllm.lora.layout import best_width
from pagedllm.lora.paged import AdapterSlabs
from pagedllm.lora.request import LoRARequest
from pagedllm.models import ModelConfig


def cells(t: torch.Tensor, w: int, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The cell table of t [R, C] cut in cells of w (each cell a tensor of its own, padded);
    keep [R, ceil(C / w)]: False leaves a cell out (address 0)."""
    r, c = t.shape
    n = -(-c // w)
    padded = torch.nn.functional.pad(t, (0, n * w - c))
    held, tab = [], torch.zeros(r, n, dtype=torch.long)
    for i in range(r):
        for j in range(n):
            if keep is None or keep[i, j]:
                cell = padded[i, j * w:(j + 1) * w].clone()
                held.append(cell)
                tab[i, j] = cell.data_ptr()
    return tab, held


def reference(out, x, rows, starts, a, bt):
    want = out.float().clone()
    for s in range(len(a)):
        idx = rows[starts[s]:starts[s + 1]]
        if a[s].shape[0]:
            want[idx] += (x[idx].float() @ a[s].float().T) @ bt[s].float()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,w", [(64, 96, 32), (72, 40, 48), (200, 150, 64)])
def test_sgmv_is_the_segments_low_rank_passes(dtype, k, n, w):
    g = torch.Generator().manual_seed(0)
    t = 23
    x, out = torch.randn(t, k, generator=g).to(dtype), torch.randn(t, n, generator=g).to(dtype)
    ranks = [8, 0, 24, 4]   # the second adapter has no pieces on this matmul
    a = [torch.randn(r, k, generator=g).to(dtype) / 4 for r in ranks]
    bt = [torch.randn(r, n, generator=g).to(dtype) / 4 for r in ranks]
    keep = [torch.rand(r, -(-n // w), generator=g) > 0.3 for r in ranks]   # cells not stored: zeros
    for b, kp in zip(bt, keep):
        for j in range(kp.shape[1]):
            b[~kp[:, j], j * w:(j + 1) * w] = 0
    tabs = [cells(m, w) for m in a], [cells(m, w, kp) for m, kp in zip(bt, keep)]
    rows = torch.randperm(t, generator=g)[:18]   # 5 rows on the base model: untouched
    starts = torch.tensor([0, 7, 9, 14, 18])
    want = reference(out, x, rows, starts, a, bt)
    got = out.clone()
    load_ops().lora_sgmv(got, x, rows, starts, [tb for tb, _ in tabs[0]], [tb for tb, _ in tabs[1]], w)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    base = torch.ones(t, dtype=torch.bool)
    base[rows] = False
    assert torch.equal(got[base], out[base])


def test_sgmv_refuses_bad_rows_and_tables():
    x, out = torch.randn(4, 32), torch.zeros(4, 16)
    held = cells(torch.randn(2, 32), 16), cells(torch.randn(2, 16), 16)   # the cells stay alive while read
    a, bt = held[0][0], held[1][0]
    ops = load_ops()
    with pytest.raises(RuntimeError, match="row 4 is outside x's 4"):
        ops.lora_sgmv(out, x, torch.tensor([0, 4]), torch.tensor([0, 2]), [a], [bt], 16)
    with pytest.raises(RuntimeError, match="seg_starts must rise from 0 to len"):
        ops.lora_sgmv(out, x, torch.tensor([0, 1]), torch.tensor([0, 1]), [a], [bt], 16)
    with pytest.raises(RuntimeError, match=r"pair 0 must be cell tables int64 A \[R, 2\]"):
        ops.lora_sgmv(out, x, torch.tensor([0]), torch.tensor([0, 1]), [a[:, :1].contiguous()], [bt], 16)
    with pytest.raises(RuntimeError, match="A cell 1 is 0"):
        ops.lora_sgmv(out, x, torch.tensor([0]), torch.tensor([0, 1]), [a * torch.tensor([1, 0])], [bt], 16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.lora_sgmv(out, x, torch.tensor([0]), torch.tensor([0, 1]), [a], [bt], 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adapter_written_into_pool_pages_reads_back_as_its_matrices(dtype):
    """lora.paged: a tiny model's pool (4 layers, KV rows of 128 elements), two adapters with a
    fused qkv piece set and a down_proj, placed in scattered pages and run in one step: the
    same delta as their dense matrices; the blocks around them are untouched."""
    mc = ModelConfig("llama", 64, 4, 4, 2, 16, 96, 32, 1e-6, 1e4, None, 128, False, False)   # hidden 64, 4 layers
    pools = [(torch.full((10, 8, 2, 16), 7.0, dtype=dtype), torch.full((10, 8, 2, 16), 7.0, dtype=dtype))
             for _ in range(4)]
    slabs = AdapterSlabs(pools, KVLayout.single(4), mc, dtype)
    assert slabs.geometry.slab == 256 and slabs.geometry.width == best_width(256, [64, 96, 32])
    g = torch.Generator().manual_seed(3)

    def module(r: int, k: int, pieces: list[tuple[int, int]], n: int) -> LoRAModule:
        return LoRAModule(torch.randn(r * len(pieces), k, generator=g).to(dtype),
                          [(c, torch.randn(r, w, generator=g).to(dtype)) for c, w in pieces], n)

    def adapter(i: int, r: int) -> LoRAAdapter:
        mods = {f"layers.{l}.self_attn.qkv_proj": module(r, 64, [(0, 64), (64, 32), (96, 32)], 128) for l in (0, 2)}
        mods["layers.1.mlp.down_proj"] = module(r, 96, [(0, 64)], 64)
        return LoRAAdapter(LoRARequest(f"a{i}", i, "/none"), r, mods)

    ads = {1: adapter(1, 4), 2: adapter(2, 8)}
    pages = {1: [7, 2, 4], 2: [5, 0, 9, 3, 1]}
    placed = {}
    for i, ad in ads.items():
        assert slabs.pages(ad) <= len(pages[i])
        placed[i] = slabs.place(ad, pages[i][:slabs.pages(ad)])
    assert [slabs.pages(a) for a in ads.values()] == [3, 5]   # 40 and 80 cells (and 40 in layer 1), 16 a page
    used = {b for i in ads for b in pages[i][:slabs.pages(ads[i])]}
    for k, v in pools:   # blocks no adapter took keep what they held
        assert all((t[b] == 7).all() for t in (k, v) for b in range(10) if b not in used)
    rows = {1: [0, 3, 4], 2: [6, 1]}
    step = lora_step(rows, placed, load_ops(), slabs.geometry.width)
    for name in ("layers.2.self_attn.qkv_proj", "layers.1.mlp.down_proj"):
        m1, m2 = ads[1].modules[name], ads[2].modules[name]
        x = torch.randn(7, m1.a.shape[1], generator=g).to(dtype)
        base = torch.randn(7, m1.out_features, generator=g).to(dtype)
        want = base.float().clone()
        for m, r in ((m1, rows[1]), (m2, rows[2])):
            want[r] += (x[r].float() @ m.a.float().T) @ m.dense_bt().float()
        got = step.add(name, x, base.clone())
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), want, **tol)
    assert step.add("layers.3.self_attn.o_proj", x, base.clone()).equal(base)   # no pieces there


def test_triton_twin_equals_the_compiled_kernel():
    """lora.triton_sgmv (the GPU's path; here under Triton's interpreter) on the same cell tables
    as the compiled kernel: cells in scattered tensors, cells left out, a segment without the matmul."""
    from pagedllm.attention import triton_available

    if triton_available() is not None:
        pytest.skip(f"Triton not available: {triton_available()}")
    from pagedllm.lora.triton_sgmv import lora_sgmv

    g = torch.Generator().manual_seed(5)
    k, n, w, t = 40, 56, 16, 9
    x, out = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
    ranks = [4, 0, 8]
    a = [torch.randn(r, k, generator=g) / 4 for r in ranks]
    bt = [torch.randn(r, n, generator=g) / 4 for r in ranks]
    keep = [torch.rand(r, -(-n // w), generator=g) > 0.3 for r in ranks]
    for b, kp in zip(bt, keep):
        for j in range(kp.shape[1]):
            b[~kp[:, j], j * w:(j + 1) * w] = 0
    held = [cells(m, w) for m in a], [cells(m, w, kp) for m, kp in zip(bt, keep)]
    a_tabs, bt_tabs = [tb for tb, _ in held[0]], [tb for tb, _ in held[1]]
    rows, starts = torch.tensor([4, 0, 7, 2, 8, 1]), [0, 2, 3, 6]
    want = out.clone()
    load_ops().lora_sgmv(want, x, rows, torch.tensor(starts), a_tabs, bt_tabs, w)
    got = out.clone()
    lora_sgmv(got, x, rows, starts, a_tabs, bt_tabs, w, base=held[0][0][1][0])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not got.equal(out)
