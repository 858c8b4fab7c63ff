"""Where the runner's big CPU tensors live: private anonymous mappings on 2 MiB transparent huge
pages, for the KV pools (kv_cache.py) and for the weights a step streams.

A decode step reads every weight it multiplies from memory, once. On 4 KiB pages the hardware's
stream prefetchers stop at each page's end and a weight of 1 GB is 260,000 TLB entries; on 2 MiB
pages a stream runs 512 times as far. Measured on a 2-core AMD EPYC Zen 4 (AVX-512 BF16, no AMX),
paired in one process (benchmarks/huge_pages.py, BENCHMARKS §58): a mixture's bf16 experts at
DeepSeek-V3/Moonlight's widths (64 of 1,408 x 2,048, 1.1 GB) and a dense matmul at 1-32 rows
1.06-1.31x faster on huge pages, the V3-shaped model's batch 1.04-1.10x; models whose decode is
compute-bound (LFM2, Granite) ~1 %. The kernel only gives huge pages to memory that asks for
them where transparent huge pages are set to "madvise" (the usual default), and torch's
allocator does not ask."""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import sys

import torch
from torch import nn

from ..util import cdiv

HUGE = 2 * 1024**2   # a transparent huge page
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23
# A weight's storage below this stays where it is: a mapping of its own holds whole huge pages
# only past 2 MiB, and packing SmolLM2's 1-2 MB layers into one huge-page arena instead gained
# nothing measurable (a scratch A/B, paired in one process: one request 0.98x, a 32-row batch
# 1.03x; its decode is bound by the step's host work, not by reading weights).
MIN_WEIGHT_BYTES = 4 * HUGE


def huge_pages_wanted() -> bool:
    """PAGEDLLM_HUGE_PAGES=0 asks for 4 KiB pages instead. Where memory is fragmented (a machine
    that has run for long, a test suite that starts dozens of engines) the kernel compacts memory
    to find huge pages as it faults the pool in: seconds of system time per start-up, which a
    short-lived engine never wins back (measured: a 256 MiB pool's first touch 0.05 s without, up
    to 5 s with; a default 2 GiB pool 9.3 s with, on a machine up for five hours)."""
    return os.environ.get("PAGEDLLM_HUGE_PAGES", "1").strip() != "0"


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The kernel's transparent huge page setting ("always", "madvise" or "never": the word in
    brackets), or None where it cannot be read (not Linux, no THP)."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def madvise(start: int, end: int, advice: int) -> bool:
    """madvise over [start, end) (page-aligned start); False where it failed or is not Linux."""
    if end <= start or not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0
    except (OSError, AttributeError):
        return False


def mapped(shape: tuple[int, ...], dtype: torch.dtype, huge: bool | None = None) -> torch.Tensor:
    """A zeroed tensor in a private anonymous mapping of its own, 2 MiB-aligned, advised to huge
    pages (or against them: huge=False, or by default with PAGEDLLM_HUGE_PAGES=0) before anything
    touches it."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # A 2 MiB-aligned start, so that every huge page of the tensor lies wholly inside it.
    buf = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE
    # frombuffer holds a reference to the mapping: it is unmapped when the last view of it goes.
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    start, end = t.data_ptr(), t.data_ptr() + nbytes
    # MADV_HUGEPAGE, or MADV_NOHUGEPAGE when they are not wanted: "not asked for" is not enough,
    # since with transparent huge pages set to "always" the kernel would still compact for them.
    huge = huge_pages_wanted() if huge is None else huge
    madvise(cdiv(start, HUGE) * HUGE, end // HUGE * HUGE, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    return t


def populate(t: torch.Tensor) -> None:
    """Faults every page of t in: MADV_POPULATE_WRITE (Linux 5.14) in one call, the kernel
    zeroing each page once; elsewhere a write of zeros over it."""
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    if not madvise(start, t.data_ptr() + t.numel() * t.element_size(), MADV_POPULATE_WRITE):
        t.zero_()


def _tensors_of(value) -> list[torch.Tensor]:
    """The tensors a module attribute holds: itself, a list's or tuple's, a dataclass's fields
    (quantized blocks), one level deep; and the base of each that is a view (to_panels(w).view(...)
    keeps its base, which holds the storage too)."""
    if isinstance(value, torch.Tensor):
        found = [value]
    elif isinstance(value, (list, tuple)):
        found = [v for v in value if isinstance(v, torch.Tensor)]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        found = [v for f in dataclasses.fields(value) if isinstance(v := getattr(value, f.name), torch.Tensor)]
    else:
        return []
    return found + [t._base for t in found if t._base is not None]


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized \
        and t.untyped_storage().nbytes() >= MIN_WEIGHT_BYTES


def populate_all(tensors: list[torch.Tensor], threads: int = 4) -> None:
    """populate() of every tensor (contiguous), in pieces of whole huge pages on a few threads at
    once: the kernel zeroes (and, on a fragmented machine, compacts memory for) each faulting
    thread's pages in parallel, and madvise releases the GIL (measured: 1 GiB of huge pages in 4
    KV pools, 3.25 s one after another, 1.13 s on 4 threads, on 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    pieces = []
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        piece = max(HUGE, cdiv(cdiv(flat.numel(), threads), HUGE) * HUGE)
        pieces += [flat[i:i + piece] for i in range(0, flat.numel(), piece)]
    if pieces:
        with ThreadPoolExecutor(max_workers=min(threads, len(pieces)), thread_name_prefix="populate") as ex:
            list(ex.map(populate, pieces))


def _move(tensors: list[torch.Tensor]) -> int:
    """The storage the tensors share, copied into a mapping on huge pages and each tensor
    re-pointed there; put back (0 bytes moved) if something else still holds the old storage,
    which would otherwise stay alive beside the copy."""
    old = tensors[0].untyped_storage()
    new = mapped((old.nbytes(),), torch.uint8)
    populate_all([new])
    new.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
    for t in tensors:
        t.set_(new.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    if torch._C._storage_Use_Count(old._cdata) > 1:   # our `old` is the one use expected
        for t in tensors:
            t.set_(old, t.storage_offset(), t.size(), t.stride())
        return 0
    return old.nbytes()


def weights_to_huge_pages(model: nn.Module) -> int:
    """Moves the storage of every big CPU tensor `model`'s modules hold (parameters, buffers, and
    the packed copies and quantized blocks kept as attributes) into a mapping of its own on huge
    pages, once the weights are packed. Every tensor found on a storage is re-pointed in place
    (Tensor.set_), so views and tied weights keep sharing one copy and every holder of a tensor
    sees the move; a storage held by something not found stays where it is. One storage at a
    time: the copy costs the largest storage's bytes at most. Returns the bytes moved (none with
    PAGEDLLM_HUGE_PAGES=0, or where the kernel has transparent huge pages off or none)."""
    if not huge_pages_wanted() or thp_mode() in (None, "never"):
        return 0   # no huge pages to be had: the copy would be pure cost
    by_storage: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            for t in _tensors_of(value):
                if id(t) not in seen and _movable(t):
                    seen.add(id(t))
                    by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    # inference mode: weights made under it are inference tensors, which set_ may re-point only there
    # (a normal tensor is re-pointed there as well, and stays normal)
    with torch.inference_mode():
        return sum(_move(tensors) for tensors in by_storage.values())
