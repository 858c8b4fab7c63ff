"""One data-parallel replica: a process that owns an LLMEngine (its own weights and KV
pool) and steps it, talking to the server's front over picklable messages.

In (a multiprocessing Queue, so the server's event loop never blocks on a busy replica):
    ("add", request_id, token_ids, params, cache_salt, owner) · ("abort", request_id) · ("stop",)
Out (a Pipe, read by one thread in the server):
    ("ready", ReplicaInfo) or ("failed", message), once, first;
    ("step", outputs, stats, tokens_run, adds_applied) after every step;
    ("stats", stats, adds_applied) while idle; ("rejected", request_id, message);
    ("finished", output) for a request aborted outside a step (the metrics count it).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ..config import EngineConfig
from ..engine.async_engine import is_fatal
from ..engine.engine import EngineStats

logger = logging.getLogger(__name__)

IDLE_WAIT = 0.5  # seconds an idle replica waits for a command before it republishes its stats


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the front needs of a started replica's engine to validate and route for it."""
    pid: int
    model_name: str
    max_model_len: int
    chars_per_token: int
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    stats: EngineStats           # the empty engine's, so the totals are whole from the start


def replica_main(index: int, cfg: EngineConfig, commands: mp.Queue, conn: Connection, log_level: str) -> None:
    """The replica process's entry point (multiprocessing "spawn" target)."""
    import os
    import signal

    # Ctrl-C, and a service manager's SIGTERM, reach the whole process group: the front
    # drains its requests first, then stops us (a parent that vanishes is noticed too).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s replica{index} %(name)s: %(message)s")
    try:
        from ..engine.engine import LLMEngine

        engine = LLMEngine(cfg)
    except Exception as e:  # a bad config or model: the front reports it and does not retry
        conn.send(("failed", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)))
        return
    engine.stream_outputs = True
    s = engine.stats()
    conn.send(("ready", ReplicaInfo(os.getpid(), engine.model_name, engine.max_model_len, engine.rules.chars_per_token,
                                    s.kv.num_blocks, s.kv.block_size, engine.kv.enable_prefix_caching, s)))
    ReplicaLoop(engine, commands, conn).run()


class ReplicaLoop:
    """AsyncLLMEngine's loop, with a queue and a pipe where it has an event loop."""

    def __init__(self, engine, commands: mp.Queue, conn: Connection) -> None:
        self.engine, self.commands, self.conn = engine, commands, conn
        self.adds_applied = 0
        self.stopping = False

    def run(self) -> None:
        parent = mp.parent_process()
        try:
            while not self.stopping:
                busy = self.engine.has_unfinished_requests()
                self._apply(block=not busy)
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self.conn.send(("stats", self.engine.stats(), self.adds_applied))
                    if parent is not None and not parent.is_alive():
                        return  # the server is gone (killed): nobody reads what we make
        except (BrokenPipeError, EOFError, OSError):
            return  # the front closed its end: it is shutting down

    def _apply(self, block: bool) -> None:
        """Every queued command; when idle, wait up to IDLE_WAIT for the first."""
        try:
            cmd = self.commands.get(timeout=IDLE_WAIT) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, salt, owner = cmd
            self.adds_applied += 1
            try:
                self.engine.add_request(rid, ids, params, salt, owner)
            except ValueError as e:
                self.conn.send(("rejected", rid, str(e)))
        elif cmd[0] == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self.conn.send(("finished", out))
        else:
            self.stopping = True

    def _step(self) -> None:
        # The step's tokens from the engine's counters: stats() walks every block table, once a step is enough.
        before = self.engine.computed_prompt_tokens + self.engine.generation_tokens
        try:
            outs = self.engine.step()
        except Exception as e:  # fail the requests in flight, keep serving (as AsyncLLMEngine does)
            if is_fatal(e):
                raise  # a tensor-parallel rank died: this process ends, the front restarts it
            logger.exception("engine step failed; aborting the requests in flight")
            msg = f"internal error in the engine step: {type(e).__name__}: {e}"
            for rid in list(self.engine.requests):
                out = self.engine.abort_request(rid)
                if out is not None:
                    out.error = msg
                    self.conn.send(("finished", out))
            return
        s = self.engine.stats()
        ran = s.computed_prompt_tokens + s.generation_tokens - before
        self.conn.send(("step", outs, s, ran, self.adds_applied))


def wait_ready(conn: Connection, proc: mp.process.BaseProcess, timeout: float,
               stop: threading.Event | None = None) -> ReplicaInfo:
    """The replica's ReplicaInfo once its engine is built; ValueError if it failed, died,
    or `stop` was set first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if conn.poll(0.2):
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "ready":
                return msg[1]
            raise ValueError(msg[1])
        if not proc.is_alive():
            break
    raise ValueError(f"replica process {proc.pid} did not start (exit code {proc.exitcode})")
