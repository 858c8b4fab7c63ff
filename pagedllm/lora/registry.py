"""Adapters read from disk into host memory (vLLM's CPU LoRA cache, `max_cpu_loras`): read on a
thread of their own when a request first names one, so the engine loop never waits on a disk;
kept while a request holds them, and up to `capacity` unused ones besides (the least recently
used dropped first: read again if asked for). The pool's copy (kv.adapter_pages, lora.paged)
is written from here.

`load` makes an adapter of a request (lora.adapter.load_adapter on a model); the cache knows
nothing else of it, so the engine core's tests run it on fake adapters."""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

from .request import LoRARequest

A = TypeVar("A")


class AdapterCache(Generic[A]):
    def __init__(self, load: Callable[[LoRARequest], A], capacity: int) -> None:
        self._load = load
        self.capacity = capacity
        self.entries: OrderedDict[int, tuple[LoRARequest, Future]] = OrderedDict()   # least recent first
        self.refs: dict[int, int] = {}   # adapter id -> unfinished requests holding it
        self.loads = 0                   # adapters read from disk, reloads included
        self._pool: ThreadPoolExecutor | None = None

    def request(self, req: LoRARequest) -> Future:
        """The adapter of `req` (a future: done at once when held, else read on the loader's
        thread); one more request holds it. ValueError if its id names another adapter."""
        held = self.entries.get(req.lora_int_id)
        if held is not None and held[0] != req:
            raise ValueError(f"lora_int_id {req.lora_int_id} is {held[0].lora_name!r} ({held[0].lora_path}); "
                             f"{req.lora_name!r} needs an id of its own")
        if held is None or (held[1].done() and held[1].exception() is not None):   # a failed read is retried
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
            held = (req, self._pool.submit(self._load, req))
            self.entries[req.lora_int_id] = held
            self.loads += 1
        self.entries.move_to_end(req.lora_int_id)
        self.refs[req.lora_int_id] = self.refs.get(req.lora_int_id, 0) + 1
        self._trim()
        return held[1]

    def held(self, lora_int_id: int) -> A:
        """The adapter a request holds, its read done (KeyError if none holds it)."""
        return self.entries[lora_int_id][1].result()

    def load_now(self, req: LoRARequest) -> A:
        """Read `req`'s adapter now, on this thread, and keep it (an offline batch checks its
        adapters before queueing anything). ValueError naming what is wrong."""
        fut = self.request(req)
        try:
            return fut.result()
        finally:
            self.release(req.lora_int_id)

    def release(self, lora_int_id: int) -> None:
        n = self.refs.get(lora_int_id, 0) - 1
        if n > 0:
            self.refs[lora_int_id] = n
        else:
            self.refs.pop(lora_int_id, None)
            entry = self.entries.get(lora_int_id)
            if entry is not None and entry[1].done() and entry[1].exception() is not None:
                del self.entries[lora_int_id]   # nothing kept of a failed read
        self._trim()

    def _trim(self) -> None:
        """Unused adapters beyond `capacity` go, least recently used first."""
        idle = [i for i in self.entries if i not in self.refs]
        for i in idle[:max(0, len(idle) - self.capacity)]:
            del self.entries[i]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
