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
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol, Sequence as Seq

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)


class StepObserver(Protocol):
    def on_step(self, outputs: list[RequestOutput], tokens: int) -> None: ...
    def on_finished(self, output: RequestOutput) -> None: ...


class StepGate(Protocol):
    """Decides, on the engine thread, when the next step may run: a watcher (the
    visualizer's controller) pauses, single-steps or slows the engine through one."""

    def poll(self) -> None:
        """Between steps, before deciding whether to step."""

    def may_step(self) -> bool:
        """Whether the engine may run a step now (it has work); True consumes the permission."""

    def after_step(self, stop: threading.Event) -> None:
        """After each step: may wait on `stop` (set at shutdown) to slow the engine down."""


class FreeRunning:
    """The default gate: step whenever there is work, at full speed."""

    def poll(self) -> None:
        pass

    def may_step(self) -> bool:
        return True

    def after_step(self, stop: threading.Event) -> None:
        pass


def is_fatal(e: BaseException) -> bool:
    """No later step can succeed: a tensor-parallel rank is gone."""
    from ..distributed.group import WorkerDiedError  # torch is loaded by now: the engine stepped

    return isinstance(e, WorkerDiedError)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue-len: try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """This request failed inside a step (the others of the batch went on)."""


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
    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None, log_interval: float = 10.0,
                 gate: StepGate | None = None) -> None:
        self.engine = engine
        self.gate: StepGate = gate or FreeRunning()
        engine.stream_outputs = True
        self.max_queue_len = max_queue_len
        self.log_interval = log_interval
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Two counters, each written by one thread only: queued adds = sent - applied.
        self._adds_sent = 0
        self._adds_applied = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.stats: EngineStats = engine.stats()  # snapshot, republished by the engine thread
        # Told on the engine thread about every step and every finished request (metrics):
        # on_step(outputs, tokens run) and on_finished(output) for aborts outside a step.
        self.observer: StepObserver | None = None
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- called from the event loop ------------------------------------------
    def validate(self, prompt: str | Seq[int], params: SamplingParams, add_special_tokens: bool = True) -> list[int]:
        return self.engine.validate(prompt, params, add_special_tokens)

    def submit(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
               cache_salt: str | None = None, owner: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request now (raising ValueError, QueueFullError or EngineDeadError at
        once) and return its stream: the request's output after each step that moved it,
        the last one finished. Closing the stream early (client gone) aborts the request
        and frees its blocks. The stream must be iterated or closed."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        ids = self.validate(prompt, params)
        if self.max_queue_len is not None and \
                self.stats.num_waiting + self._adds_sent - self._adds_applied >= self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); retry later")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._adds_sent += 1
        self._send(("add", request_id, ids, params, cache_salt, owner))
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
        self._send(("call", fn, loop, fut))
        return await fut

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # -- the engine thread ---------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, salt, owner = cmd
                self._adds_applied += 1
                if rid not in self._streams:
                    continue  # the client left before it was queued
                try:
                    self.engine.add_request(rid, prompt, params, salt, owner)
                except ValueError as e:
                    self._deliver(rid, e)
            elif cmd[0] == "call":
                _, fn, loop, fut = cmd
                try:
                    result, ok = fn(self.engine), True
                except Exception as e:  # handed to the caller, like any exception it would raise
                    result, ok = e, False
                loop.call_soon_threadsafe(_settle, fut, result, ok)
            else:
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._observe("on_finished", out)
                    self._deliver(cmd[1], out)

    def _run(self) -> None:
        last_log, last = time.monotonic(), self.engine.stats()
        try:
            while not self._stop.is_set():
                self._apply_commands()
                self.gate.poll()
                if self.engine.has_unfinished_requests() and self.gate.may_step():
                    try:
                        outs = self.engine.step()
                    except Exception as e:  # fail the requests in flight, keep serving
                        if is_fatal(e):
                            raise
                        logger.exception("engine step failed; aborting the requests in flight")
                        self._fail_all(RuntimeError(f"internal error in the engine step: {type(e).__name__}: {e}"))
                        continue
                    # Publish the counters before the outputs: a client that has its answer
                    # must find it counted in /metrics.
                    before, self.stats = self.stats, self.engine.stats()
                    ran = (self.stats.computed_prompt_tokens + self.stats.generation_tokens
                           - before.computed_prompt_tokens - before.generation_tokens)
                    self._observe("on_step", outs, ran)
                    for out in outs:
                        self._deliver(out.request_id, out if out.error is None else
                                      RequestFailedError(f"request failed: {out.error}"))
                    self.gate.after_step(self._stop)
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self.stats = self.engine.stats()
                if time.monotonic() - last_log >= self.log_interval:
                    # One line per interval while there is anything to report.
                    if self.stats.steps != last.steps or self.stats.num_running or self.stats.num_waiting:
                        last = self._log_status(last, time.monotonic() - last_log)
                    last_log = time.monotonic()
        except BaseException as e:  # a crashed engine must fail its requests, not hang them
            logger.exception("engine loop died")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine failed: {e}"))
        finally:
            self._fail_all(EngineDeadError("the server is shutting down"))
            # The engine thread ran every collective, so it leaves the tensor-parallel
            # group too: a group left to the interpreter's exit, its peer gone, aborts it.
            self.engine.close()

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self.engine.requests):
            out = self.engine.abort_request(rid)
            if out is not None:
                self._observe("on_finished", out)
            self._deliver(rid, error)

    def _observe(self, method: str, *args) -> None:
        if self.observer is None:
            return
        try:  # a metrics bug must not kill the engine loop
            getattr(self.observer, method)(*args)
        except Exception:
            logger.exception("metrics observer failed")

    def _log_status(self, last: EngineStats, dt: float) -> EngineStats:
        s = self.stats
        q, h = s.kv.prefix_queries - last.kv.prefix_queries, s.kv.prefix_hits - last.kv.prefix_hits
        logger.info("running: %d reqs, waiting: %d reqs, KV usage: %.1f%% (%d cached-free blocks), "
                    "prefix hit rate: %.1f%%, prompt: %.1f tok/s, generation: %.1f tok/s",
                    s.num_running, s.num_waiting, 100 * s.kv.usage, s.kv.cached_free_blocks,
                    100 * h / q if q else 0.0, (s.computed_prompt_tokens - last.computed_prompt_tokens) / dt,
                    (s.generation_tokens - last.generation_tokens) / dt)
        return s
