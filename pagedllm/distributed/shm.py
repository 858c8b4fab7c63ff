"""The ranks of one machine add their partial sums through shared memory instead of
gloo's loopback TCP (the kernel: kernels/csrc/shm_allreduce.cpp)."""
from __future__ import annotations

import logging
import os
import tempfile

import torch

from .group import TPGroup

logger = logging.getLogger(__name__)

SLOT_BYTES = 2 * 1024**2   # per rank and slot set: a larger tensor goes in pieces
_FLAG_BYTES = 64           # as in the kernel


def attach(group: TPGroup, kernels, wanted: bool) -> bool:
    """Every rank calls this at the same point. Rank 0 makes the region in /dev/shm and
    sends its name; each rank maps it; all use it only if all could (else gloo)."""
    size = group.size * _FLAG_BYTES + 2 * group.size * SLOT_BYTES
    name = None
    if group.is_driver and wanted and kernels is not None:
        name = _create(size)
    name = group.broadcast(name)
    region = None
    if name is not None and kernels is not None:
        try:
            region = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
        except RuntimeError as e:
            logger.warning("shared-memory all-reduce: cannot map %s (%s)", name, e)
    ok = group.min(int(region is not None)) == 1  # also the barrier before the unlink
    if group.is_driver and name is not None:
        os.unlink(name)  # the mappings stay; nothing is left in /dev/shm however the ranks end
    if ok:
        group.shm = (kernels, region, SLOT_BYTES)
    return ok


def _create(size: int) -> str | None:
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if root is None:
        return None
    try:
        fd, name = tempfile.mkstemp(dir=root, prefix="pagedllm-tp-")
        os.ftruncate(fd, size)
        os.close(fd)
        return name
    except OSError as e:
        logger.warning("shared-memory all-reduce: cannot create a region in /dev/shm (%s); using gloo", e)
        return None
