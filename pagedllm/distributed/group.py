"""One tensor-parallel group: the collectives the sharded model and the runner use.

Rank 0 runs the scheduler and samples; every rank holds a slice of the weights and of
the KV pool. The group is torch.distributed's default process group (gloo on CPU, NCCL
on CUDA); a group of one does no communication at all."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist


# How long the ranks may wait for each other inside one all-reduce: only the skew of
# one layer's compute between ranks (gloo's own timeout plays this part for gloo).
_SHM_PATIENCE_S = float(os.environ.get("PAGEDLLM_TP_TIMEOUT", "900"))


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot step any more."""


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1   # ranks on this machine: they share its cores and RAM
    # In a torch.distributed group (a group of one too, PAGEDLLM_TP_GROUP=1: the GPU check
    # runs TP=1 through the collectives); False: no communication at all.
    distributed: bool = False
    # Rank 0 asks this which rank died when a collective fails (the launcher knows its processes).
    diagnose: Callable[[], str | None] = field(default=lambda: None, repr=False)
    # (kernels, region, slot bytes) once the ranks of one machine share memory (shm.attach): the
    # all-reduce goes through it instead of gloo.
    shm: Any = field(default=None, repr=False)
    shm_seq: int = 0
    # Time spent in collectives and how many, for the benchmark of what TP costs per step.
    comm_seconds: float = 0.0
    comm_calls: int = 0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (gloo reduces bf16 natively, as NCCL does)."""
        if not self.distributed:
            return x
        t0 = time.perf_counter()
        if self.shm is not None and x.device.type == "cpu" and x.is_contiguous():
            self._shm_all_reduce(x)
        else:
            self._guard(dist.all_reduce, x)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        return x

    def _shm_all_reduce(self, x: torch.Tensor) -> None:
        ops, region, slot_bytes = self.shm
        flat = x.view(-1)
        step = slot_bytes // x.element_size()
        for lo in range(0, flat.numel(), step):
            piece = flat[lo:lo + step]
            self.shm_seq += 1
            ops.shm_post(piece, region, self.rank, self.size, self.shm_seq)
            waited = 0.0
            while not ops.shm_wait_sum(piece, region, self.size, self.shm_seq, 500):
                # A rank that died never raises its flag: ask who, rather than wait forever.
                waited += 0.5
                who = self.diagnose()
                if who or waited >= _SHM_PATIENCE_S:
                    raise WorkerDiedError(who or f"no tensor-parallel rank answered for {waited:.0f} s")

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets the full [rows, vocab] from every rank's [rows, vocab/size] slice;
        the others get None (only rank 0 samples)."""
        if not self.distributed:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        self._guard(dist.gather, x, parts, 0)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank (pickled: a step plan is a few lists of ints)."""
        if not self.distributed:
            return obj
        box = [obj]
        self._guard(dist.broadcast_object_list, box, 0)
        return box[0]

    def min(self, n: int) -> int:
        """The smallest n over the ranks (e.g. the KV blocks every rank can hold)."""
        if not self.distributed:
            return n
        t = torch.tensor([n], dtype=torch.long)
        self._guard(dist.all_reduce, t, dist.ReduceOp.MIN)
        return int(t.item())

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except (RuntimeError, ValueError, OSError) as e:  # gloo and NCCL raise RuntimeError subclasses
            who = self.diagnose() or "a tensor-parallel rank stopped answering"
            detail = str(e).splitlines()[0].split(". This is typically")[0][:300]  # gloo's hint says the same
            raise WorkerDiedError(f"{who}: {detail}") from e
