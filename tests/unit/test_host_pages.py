"""A model's big weights moved onto 2 MiB pages once packed (runtime/host_pages.py): every tensor
on a moved storage is re-pointed in place, values kept, shared storages still shared, the old
copy freed; a storage something else still holds stays where it is; nothing moves with
PAGEDLLM_HUGE_PAGES=0."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

from pagedllm.runtime import host_pages
from pagedllm.runtime.host_pages import HUGE, MIN_WEIGHT_BYTES, weights_to_huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


@dataclasses.dataclass
class Held:   # as quantized blocks are kept: a dataclass of tensors on a module
    codes: torch.Tensor
    scales: torch.Tensor


def _flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping holding t's first byte (/proc/self/smaps)."""
    addr, flags, inside = t.data_ptr(), set(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = set(line.split()[1:])
    return flags


def _model() -> nn.Module:
    big = MIN_WEIGHT_BYTES // 2   # elements of bf16: one storage of MIN_WEIGHT_BYTES
    g = torch.Generator().manual_seed(0)
    m = nn.Module()
    m.embed = nn.Embedding(big // 512, 512).bfloat16()
    m.head = nn.Linear(512, big // 512, bias=False).bfloat16()
    m.head.weight = m.embed.weight                        # tied: one storage, two holders
    m.packed = torch.randn(2, big // 2, generator=g).bfloat16().view(big // 256, 256)   # a view; its base too
    m.blocks = Held(torch.randint(-8, 8, (2 * big,), dtype=torch.int8, generator=g), torch.rand(big // 32 + 1))
    m.small = torch.randn(100)                            # below the size worth a mapping
    m.stack = [torch.randn(big // 2, generator=g), 3]     # in a list
    m.requires_grad_(False)
    return m


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    return {"embed": m.embed.weight, "head": m.head.weight, "packed": m.packed, "codes": m.blocks.codes,
            "scales": m.blocks.scales, "small": m.small, "stack": m.stack[0]}


def test_big_weights_move_to_huge_pages_and_keep_their_values(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    m = _model()
    before = {k: v.clone() for k, v in _tensors(m).items()}
    old = {k: v.untyped_storage() for k, v in _tensors(m).items()}
    moved = weights_to_huge_pages(m)
    now = _tensors(m)
    big = {"embed", "packed", "codes", "stack"}   # scales: a small storage; head: embed's
    assert moved == sum(old[k].nbytes() for k in big)
    for k, t in now.items():
        assert torch.equal(t, before[k]), k
        if k in big or k == "head":
            assert t.data_ptr() % HUGE == 0 and "hg" in _flags(t), k
            # the old storage: only our `old` reference to it is left, so its memory is freed
            assert torch._C._storage_Use_Count(old[k]._cdata) == 1, k
        else:
            assert t.data_ptr() == old[k].data_ptr(), k
    assert m.head.weight.data_ptr() == m.embed.weight.data_ptr()      # still tied
    assert m.packed._base.data_ptr() == m.packed.data_ptr()          # the view's base moved with it
    m.embed.weight.data[0, 0] = 7.0                                  # writable, shared
    assert m.head.weight[0, 0].item() == 7.0


def test_a_storage_held_elsewhere_stays(monkeypatch):
    """Moving it would leave the other holder's copy alive beside ours: twice the memory."""
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    m = _model()
    other = m.stack[0][:10]          # a view kept outside the module
    ptr = m.stack[0].data_ptr()
    weights_to_huge_pages(m)
    assert m.stack[0].data_ptr() == ptr and other.data_ptr() == ptr
    assert m.embed.weight.data_ptr() % HUGE == 0


def test_nothing_moves_when_huge_pages_are_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    m = _model()
    ptrs = {k: v.data_ptr() for k, v in _tensors(m).items()}
    assert weights_to_huge_pages(m) == 0
    assert {k: v.data_ptr() for k, v in _tensors(m).items()} == ptrs


def test_mapped_tensors_are_zeroed_and_aligned(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    t = host_pages.mapped((3, HUGE // 4 + 5), torch.float32)
    host_pages.populate_all([t])
    assert t.data_ptr() % HUGE == 0 and t.abs().sum().item() == 0 and t.shape == (3, HUGE // 4 + 5)


def test_inference_tensors_move_and_normal_ones_stay_normal(monkeypatch):
    """Weights made under torch.inference_mode are inference tensors, which set_ may re-point only
    inside it; a normal tensor moved there stays normal (in-place ops on it outside still work)."""
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    m = nn.Module()
    with torch.inference_mode():
        m.made_inside = torch.ones(MIN_WEIGHT_BYTES // 4)
    m.made_outside = torch.ones(MIN_WEIGHT_BYTES // 4)
    assert weights_to_huge_pages(m) == 2 * MIN_WEIGHT_BYTES
    assert m.made_inside.data_ptr() % HUGE == 0 and m.made_outside.data_ptr() % HUGE == 0
    assert not m.made_outside.is_inference()
    m.made_outside.add_(1)
    assert m.made_outside.sum().item() == 2 * m.made_outside.numel()


@pytest.mark.parametrize("setting, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                                           ("always madvise [never]\n", "never"), (None, None)])
def test_nothing_moves_where_the_kernel_gives_no_huge_pages(monkeypatch, tmp_path, setting, mode):
    """With transparent huge pages "never" (or no THP at all) the copy would be pure cost."""
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(host_pages, "THP_ENABLED", str(path))
    assert host_pages.thp_mode() == mode
    m = _model()
    moved = weights_to_huge_pages(m)
    assert (moved > 0) == (mode in ("always", "madvise"))
