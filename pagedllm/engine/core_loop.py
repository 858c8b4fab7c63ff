"""The one engine-core loop: between steps apply the commands that arrived (add, abort,
call, stop), step when there is work and the gate allows, hand the step's outputs and
figures to a sink, and fail what a step could not run.

AsyncLLMEngine runs it on a thread, its sink an event loop's request streams; a
data-parallel replica runs it in its own process, its sink a pipe to the front. Command
dispatch, fatal errors and failing the requests in flight are written here once.

Commands (tuples): ("add", request_id, token_ids, params, cache_salt, owner, priority, lora_request) ·
("abort", request_id) · ("call", fn, done): done(fn(engine), True), or done(error, False) ·
("stop",).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from ..outputs import RequestOutput
from .engine import LLMEngine
from .stats import EngineStats

logger = logging.getLogger(__name__)

IDLE_WAIT = 0.5  # seconds an idle loop waits for a command before it republishes its figures


def is_fatal(e: BaseException) -> bool:
    """No later step can succeed: a tensor-parallel rank is gone."""
    from ..distributed.group import WorkerDiedError  # torch is loaded by now: the engine stepped

    return isinstance(e, WorkerDiedError)


class StepGate(Protocol):
    """Decides, on the loop's thread, when the next step may run: a watcher (the
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


class CommandSource(Protocol):
    def get(self, timeout: float) -> tuple | None:
        """The next command; waits up to `timeout` seconds for one (0: only if queued)."""


class LoopSink(Protocol):
    """Where the loop's results go. Called on the loop's thread."""

    def wants(self, request_id: str) -> bool:
        """Whether a request about to be added still has a reader (its client may have left)."""

    def rejected(self, request_id: str, error: ValueError) -> None:
        """add_request refused it (a rule only the engine can check)."""

    def stepped(self, outputs: list[RequestOutput], view: EngineStats, tokens_run: int,
                adds_applied: int, moved: list[str]) -> None:
        """After a step: the figures first (an answered request must be counted), then outputs.
        `moved`: the requests the step moved, by tokens or a failure (a FINAL_ONLY one has no
        output until its last)."""

    def finished(self, output: RequestOutput) -> None:
        """A request ended outside a step's outputs: aborted, or failed with its step (error set)."""

    def idle(self, view: EngineStats, adds_applied: int) -> bool:
        """Nothing to step: republish the figures. False ends the loop (nobody reads it)."""

    def died(self, error: BaseException) -> None:
        """The loop cannot go on (a rank died, a bug): may re-raise."""

    def closed(self) -> None:
        """The loop ended, for whatever reason (its requests still open are to be failed)."""


class EngineCoreLoop:
    def __init__(self, engine: LLMEngine, source: CommandSource, sink: LoopSink, gate: StepGate | None = None,
                 log_interval: float | None = None) -> None:
        self.engine, self.source, self.sink = engine, source, sink
        self.gate: StepGate = gate or FreeRunning()
        self.log_interval = log_interval   # None: no status lines (a data-parallel front logs them)
        self.adds_applied = 0
        self.stopping = False
        engine.stream_outputs = True

    def run(self, stop: threading.Event) -> None:
        engine = self.engine
        last_log, last = time.monotonic(), engine.view
        try:
            while not stop.is_set() and not self.stopping:
                self._apply(self.source.get(0))
                self.gate.poll()
                if engine.has_unfinished_requests() and self.gate.may_step():
                    self._step()
                    self.gate.after_step(stop)
                else:
                    self._apply(self.source.get(IDLE_WAIT))
                    if not engine.has_unfinished_requests() and engine.kv.tier_backlog():
                        engine.core_step()   # written now, for the other replicas: not at the next request
                    if not self.sink.idle(engine.refresh_view(), self.adds_applied):
                        return
                if self.log_interval is not None and time.monotonic() - last_log >= self.log_interval:
                    last = self._log_status(last, time.monotonic() - last_log)
                    last_log = time.monotonic()
        except BaseException as e:  # a crashed engine must fail its requests, not hang them
            self.sink.died(e)
        finally:
            self.sink.closed()

    # -- commands ----------------------------------------------------------------
    def _apply(self, cmd: tuple | None) -> None:
        while cmd is not None:
            self._command(cmd)
            cmd = self.source.get(0)

    def _command(self, cmd: tuple) -> None:
        engine, kind = self.engine, cmd[0]
        if kind == "add":
            _, rid, prompt, params, salt, owner, priority, lora = cmd
            self.adds_applied += 1
            if not self.sink.wants(rid):
                return  # the client left before it was queued
            try:
                engine.add_request(rid, prompt, params, salt, owner, priority=priority, lora_request=lora)
            except ValueError as e:
                self.sink.rejected(rid, e)
        elif kind == "abort":
            out = engine.abort_request(cmd[1])
            if out is not None:
                self.sink.finished(out)
        elif kind == "call":
            _, fn, done = cmd
            try:
                result, ok = fn(engine), True
            except Exception as e:  # handed to the caller, like any exception it would raise
                result, ok = e, False
            done(result, ok)
        elif kind == "stop":
            self.stopping = True
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    # -- steps -------------------------------------------------------------------
    def _step(self) -> None:
        engine = self.engine
        before = engine.tokens_run
        try:
            up = engine.core_step()
            outputs = engine.process(up) if up is not None else []
        except Exception as e:  # fail the requests in flight, keep serving
            if is_fatal(e):
                raise
            logger.exception("engine step failed; aborting the requests in flight")
            self.fail_all(f"internal error in the engine step: {type(e).__name__}: {e}")
            return
        ran = engine.tokens_run - before
        self.sink.stepped(outputs, engine.view, ran, self.adds_applied, list(up.touched) if up is not None else [])

    def fail_all(self, error: str) -> None:
        """End every request now (their blocks go back), each output carrying `error`."""
        for rid in list(self.engine.requests):
            out = self.engine.abort_request(rid)
            if out is not None:
                out.error = error
                self.sink.finished(out)

    def _log_status(self, last: EngineStats, dt: float) -> EngineStats:
        """One line per interval while there is anything to report."""
        s = self.engine.view
        if s.steps == last.steps and not s.num_running and not s.num_waiting:
            return s
        q, h = s.kv.prefix_queries - last.kv.prefix_queries, s.kv.prefix_hits - last.kv.prefix_hits
        logger.info("running: %d reqs, waiting: %d reqs, KV usage: %.1f%% (%d cached-free blocks), "
                    "prefix hit rate: %.1f%%, prompt: %.1f tok/s, generation: %.1f tok/s",
                    s.num_running, s.num_waiting, 100 * s.kv.usage, s.kv.cached_free_blocks,
                    100 * h / q if q else 0.0, (s.computed_prompt_tokens - last.computed_prompt_tokens) / dt,
                    (s.generation_tokens - last.generation_tokens) / dt)
        return s
