"""LoRA's one owner in the engine: a request's adapter from add_request to its end, and its
part in each step (a StepHook).

A request names its adapter (vLLM's LoRARequest). From add_request it holds the adapter in
host memory (the runner's cache, lora.registry: read on the loader's thread if it is not
there); it waits in the queue until the read ends, then until fewer than max_loras adapters
run or its own already does. A sequence about to run holds the adapter's pages in the KV pool
(kv.adapter_pages: placed, counted with its blocks), and drops them when it stops running;
the step's plan carries the pages placed and evicted, and each chunk its adapter's id, for the
runner to write and read. The scheduler and admission know none of this: they ask their hooks.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..lora.registry import AdapterCache
from ..lora.request import LoRARequest
from ..plan import ChunkPlan, StepPlan
from .hooks import StepHook
from .step_types import Wait

if TYPE_CHECKING:
    from ..kv.prefix_hit import PrefixHit
    from .sequence import Request, Sequence
    from .step_types import ScheduledSeq

LORA_LOADING = Wait("its LoRA adapter is being read")
LORA_SLOTS = Wait("max_loras adapters already run")


@dataclass(frozen=True, slots=True)
class LoRAUse:
    """The adapters of running and of waiting requests, by name (vLLM's lora_requests_info),
    and the most one step runs."""
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_loras: int = 0


class LoRAHook(StepHook):
    def __init__(self, cache: AdapterCache | None, max_loras: int) -> None:
        """cache: the runner's adapters in host memory (None: it serves none)."""
        self.cache = cache
        self.max_loras = max_loras
        self.reading: dict[str, tuple[Request, Future]] = {}   # request id -> its adapter's read, not yet settled

    # -- a request's life ----------------------------------------------------
    def _checked(self, lora: LoRARequest) -> AdapterCache:
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if self.cache is None:
            raise ValueError("lora_request: this engine serves no adapters; start it with enable_lora=True "
                             "(--enable-lora)")
        return self.cache

    def check(self, lora: LoRARequest | None) -> None:
        """Read `lora`'s adapter now (kept in host memory), blocking; ValueError naming what is
        wrong with it. An offline batch checks its adapters before queueing anything."""
        if lora is not None:
            self._checked(lora).load_now(lora)

    def acquire(self, lora: LoRARequest | None) -> Future | None:
        """A request about to be queued holds its adapter in host memory from here: its read
        (started, if it must be). The last of add_request's checks: ValueError changes nothing."""
        return None if lora is None else self._checked(lora).request(lora)

    def release(self, lora: LoRARequest | None) -> None:
        """A request that held `lora` ended (or was refused after acquire)."""
        if lora is not None:
            self.cache.release(lora.lora_int_id)

    def queued(self, req: Request, read: Future | None) -> None:
        """`req` is queued: it waits for its adapter's read."""
        if read is not None:
            self.reading[req.request_id] = (req, read)

    def ended(self, req: Request) -> None:
        """`req` ended (finished, failed or aborted): its adapter loses a holder."""
        self.reading.pop(req.request_id, None)
        self.release(req.lora)

    def pending(self) -> list[Future]:
        return [read for _, read in self.reading.values()]

    def settle(self, fail) -> list[Request]:
        """Requests whose adapter read ended since the last step: ready to be admitted, or failed
        with the read's error (fail(req, message)); returns those."""
        failed = []
        for rid, (req, read) in list(self.reading.items()):
            if not read.done():
                continue
            del self.reading[rid]
            if req.finished:
                continue
            try:
                read.result()
            except Exception as e:  # the read's own error: the request's, not the engine's
                fail(req, str(e))
                failed.append(req)
        return failed

    def use(self, running: list[Sequence], waiting) -> LoRAUse | None:
        if self.cache is None:
            return None
        def names(seqs) -> tuple[str, ...]:
            return tuple(sorted({s.request.lora.lora_name for s in seqs if s.request.lora is not None}))
        return LoRAUse(names(running), names(waiting), self.max_loras)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    # -- its part in each step ------------------------------------------------
    def admit(self, seq: Sequence, hit: PrefixHit, start: int, alone: bool) -> tuple[PrefixHit, int] | Wait:
        req = seq.request
        if req.lora is None:
            return hit, start
        if req.request_id in self.reading:   # its adapter is not read yet
            return LORA_LOADING
        users = self.scheduler.kv.adapters.users
        if req.lora_id not in users and len(users) >= self.max_loras:
            return LORA_SLOTS
        return hit, start

    def _pages(self, adapter_id: int) -> int:
        """The KV pages a held adapter takes (read, as admit waited for it)."""
        return self.cache.held(adapter_id).num_pages

    def extra_blocks(self, seq: Sequence) -> int:
        a = seq.request.lora_id
        return self.scheduler.kv.adapters.cost(a, self._pages(a)) if a else 0

    def hold(self, seq: Sequence) -> bool:
        a = seq.request.lora_id
        return not a or self.scheduler.kv.adapters.acquire(a, self._pages(a))

    def drop(self, seq: Sequence) -> None:
        if seq.request.lora is not None:   # the last user leaves it idle, resident
            self.scheduler.kv.adapters.release(seq.request.lora_id)

    def plan(self, chunk: ChunkPlan, s: ScheduledSeq) -> None:
        chunk.lora_id = s.seq.request.lora_id

    def planned(self, plan: StepPlan) -> None:
        adapters = self.scheduler.kv.adapters
        plan.adapter_evictions = adapters.take_evictions()
        plan.adapter_loads = adapters.take_loads()
