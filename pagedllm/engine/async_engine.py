"""A background thread steps the engine; asyncio callers add, abort and stream.

The event loop never waits on a forward pass: it only validates requests and puts
commands on a queue. The engine thread applies them between steps, runs the step, and
hands each request's outputs back to the loop that asked.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence as Seq

from ..lora.request import LoRARequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, StructuredOutputsParams
from ..structured import mark_checked
from .client import (EngineDeadError, EngineInfo, QueueFullError, RequestFailedError, StepObserver,  # noqa: F401
                     failure)
from .core_loop import EngineCoreLoop, StepGate
from .engine import LLMEngine
from .stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


async def read_stream(stream: _Stream, leave: Callable[[bool], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs up to its last, raising an error put on its stream; leave(finished)
    runs however the reading ends (the client may go first)."""
    finished = False
    try:
        while True:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        leave(finished)


def _settle(fut: asyncio.Future, result, ok: bool) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(result)
    else:
        fut.set_exception(result)


class AsyncLLMEngine:
    """An EngineClient: the engine-core loop on a thread, request streams on the event loop."""

    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None, log_interval: float = 10.0,
                 gate: StepGate | None = None) -> None:
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.max_queue_len = max_queue_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Two counters, each written by one thread only: queued adds = sent - applied.
        self._adds_sent = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.stats: EngineStats = engine.stats()  # the latest view, republished by the engine thread
        # Told on the engine thread about every step and every finished request (metrics):
        # on_step(outputs, tokens run) and on_finished(output) for aborts outside a step.
        self.observer: StepObserver | None = None
        self._loop = EngineCoreLoop(engine, self, self, gate, log_interval)
        self._thread = threading.Thread(target=self._loop.run, args=(self._stop,), name="pagedllm-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def gate(self) -> StepGate:
        return self._loop.gate

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- the EngineClient interface (the event loop's side) ------------------------
    def validate(self, prompt: str | Seq[int], params: SamplingParams, add_special_tokens: bool = True) -> list[int]:
        return self.engine.validate(prompt, params, add_special_tokens)

    async def check_structured(self, so: StructuredOutputsParams, tenant: str | None = None) -> None:
        await asyncio.wrap_future(self.engine.grammars.submit(so, tenant=tenant))
        mark_checked(so)

    def submit(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
               cache_salt: str | None = None, owner: str | None = None,
               priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request now (raising ValueError, QueueFullError or EngineDeadError at
        once) and return its stream: the request's output after each step that moved it
        (as its output_kind says), the last one finished. Closing the stream early (client
        gone) aborts the request and frees its blocks. The stream must be iterated or closed."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        ids = self.validate(prompt, params)
        if self.max_queue_len is not None and \
                self.stats.num_waiting + self._adds_sent - self._loop.adds_applied >= self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); retry later")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._adds_sent += 1
        self._send(("add", request_id, ids, params, cache_salt, owner, priority, lora_request))
        return self._iterate(request_id, stream)

    def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        def leave(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:  # the client left: free its blocks
                self._send(("abort", request_id))
        return read_stream(stream, leave)

    async def generate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.submit(request_id, prompt, params, cache_salt):
            yield out

    def wake(self) -> None:
        """Have the engine thread look at its inputs now (not after its idle wait)."""
        self._wake.set()

    async def call(self, fn):
        """Run fn(engine) on the engine thread between steps and return its result: a
        consistent read of state the engine thread owns."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self._send(("call", fn, lambda result, ok: loop.call_soon_threadsafe(_settle, fut, result, ok)))
        return await fut

    async def get_stats(self) -> EngineStats:
        """The figures now, the KV slot figures walked (a /metrics scrape): asked of the
        engine thread between steps; the latest view once the engine is gone."""
        if not self.alive:
            return self.stats
        return await self.call(self._publish_walked)

    def _publish_walked(self, engine: LLMEngine) -> EngineStats:
        # On the engine thread, which alone writes self.stats.
        self.stats = engine.refresh_view()
        return self.stats

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # -- CommandSource and LoopSink: the engine thread's side ----------------------
    def get(self, timeout: float) -> tuple | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            if not timeout:
                return None
        self._wake.wait(timeout)
        self._wake.clear()
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def wants(self, request_id: str) -> bool:
        return request_id in self._streams

    def rejected(self, request_id: str, error: ValueError) -> None:
        self._deliver(request_id, error)

    def stepped(self, outputs: list[RequestOutput], view: EngineStats, tokens_run: int, adds_applied: int,
                moved: list[str]) -> None:
        # Publish the counters before the outputs: a client that has its answer must find
        # it counted in /metrics.
        self.stats = view
        self._observe("on_step", outputs, tokens_run, moved)
        for out in outputs:
            self._deliver(out.request_id, out if out.error is None else failure(out))

    def finished(self, output: RequestOutput) -> None:
        self._observe("on_finished", output)
        self._deliver(output.request_id, output if output.error is None else RuntimeError(output.error))

    def idle(self, view: EngineStats, adds_applied: int) -> bool:
        self.stats = view
        return True

    def died(self, error: BaseException) -> None:
        logger.exception("engine loop died")
        self.error = error
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"engine failed: {error}"))

    def closed(self) -> None:
        while True:  # a call still queued (a /metrics scrape) must not wait for ever
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "call":
                cmd[2](EngineDeadError("the engine is not running"), False)
        for rid in list(self.engine.requests):
            out = self.engine.abort_request(rid)
            if out is not None:
                self._observe("on_finished", out)
            self._deliver(rid, EngineDeadError("the server is shutting down"))
        # The engine thread ran every collective, so it leaves the tensor-parallel
        # group too: a group left to the interpreter's exit, its peer gone, aborts it.
        self.engine.close()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _observe(self, method: str, *args) -> None:
        if self.observer is None:
            return
        try:  # a metrics bug must not kill the engine loop
            getattr(self.observer, method)(*args)
        except Exception:
            logger.exception("metrics observer failed")
