"""How the KV pool is sized: an explicit budget wins; on CUDA, gpu_memory_utilization of the
device less what the process holds and the profile run's activations (+ a margin); on CPU,
a share of free RAM. The CUDA arithmetic is checked with the device's memory figures
stubbed, since this machine has no GPU."""
from __future__ import annotations


import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.runtime import kv_cache
from pagedllm.runtime.kv_cache import _CUDA_MARGIN, kv_budget

GiB = 1024**3
CUDA = torch.device("cuda")


@pytest.fixture
def device_memory(monkeypatch):
    """An 80 GiB device with 10 GiB already in use (weights, context)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 80 * GiB))


def test_explicit_budget_wins_and_skips_the_profile_run(device_memory):
    def profile():
        raise AssertionError("profile run with an explicit budget")
    assert kv_budget(EngineConfig(model="m", kv_cache_memory="3GiB"), CUDA, profile) == 3 * GiB


def test_cuda_budget_is_utilization_less_in_use_less_activations(device_memory):
    calls = []

    def profile():
        calls.append(1)
        return 2 * GiB
    got = kv_budget(EngineConfig(model="m", gpu_memory_utilization=0.5), CUDA, profile)
    assert got == int(80 * GiB * 0.5) - 10 * GiB - 2 * GiB - _CUDA_MARGIN
    assert calls == [1]
    # No profile callable: a fixed 512 MiB stands in for the activations.
    assert kv_budget(EngineConfig(model="m", gpu_memory_utilization=0.5), CUDA) == \
        int(80 * GiB * 0.5) - 10 * GiB - 512 * 1024**2 - _CUDA_MARGIN


def test_cuda_budget_that_leaves_nothing_names_the_knob(device_memory):
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.1 leaves no room"):
        kv_budget(EngineConfig(model="m", gpu_memory_utilization=0.1), CUDA, lambda: GiB)


def test_cpu_budget_is_a_share_of_free_ram(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_ram", lambda: 4 * GiB)
    assert kv_budget(EngineConfig(model="m"), torch.device("cpu")) == GiB
    monkeypatch.setattr(kv_cache, "available_ram", lambda: 64 * GiB)
    assert kv_budget(EngineConfig(model="m"), torch.device("cpu")) == 2 * GiB


def _advised(t: torch.Tensor, flag: str = "hg") -> bool:
    """Whether a mapping over the tensor's bytes carries MADV_HUGEPAGE ("hg" in its VmFlags in
    /proc/self/smaps; "nh": MADV_NOHUGEPAGE). The advice, not the pages: whether the kernel
    finds free 2 MiB pages depends on how fragmented memory is at that moment."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    inside, advised = False, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "VmFlags:":
                advised |= flag in line.split()[1:]
    return advised


@pytest.mark.parametrize("wanted", ["1", "0"])
def test_pool_is_advised_to_huge_pages_unless_turned_off(monkeypatch, wanted):
    """The pool is advised to 2 MiB pages unless PAGEDLLM_HUGE_PAGES=0 (the test suite's
    setting: see tests/conftest.py), which advises against them. Both ways, whatever the
    memory held before: an earlier pool's advice stays with its addresses, and a new pool
    may land on them (seen in the full suite)."""
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", wanted)
    for _ in range(2):  # the second pool reuses the first one's addresses
        pool = kv_cache.allocate_pool((16, 2**20), torch.float32, torch.device("cpu"))   # 64 MiB
        assert pool.abs().sum().item() == 0
        assert _advised(pool, "hg") == (wanted == "1") and _advised(pool, "nh") == (wanted == "0")
        del pool
