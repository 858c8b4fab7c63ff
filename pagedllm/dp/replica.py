"""One data-parallel replica: a process that owns an LLMEngine (its own weights and KV
pool) and steps it, talking to the server's front over picklable messages.

The loop is the engine-core loop (pagedllm.engine.core_loop), as in AsyncLLMEngine.
In (a multiprocessing Queue, so the server's event loop never blocks on a busy replica):
    ("add", request_id, token_ids, params, cache_salt, owner, priority, lora_request) · ("abort", request_id) · ("stop",) · ("stats",)
Out (a Pipe, read by one thread in the server):
    ("ready", ReplicaInfo) or ("failed", message), once, first;
    ("step", outputs, view, tokens_run, adds_applied, moved) after every step (the view:
    counters; moved: the requests that got tokens);
    ("stats", stats, adds_applied) while idle, and after a ("stats",) command (walked figures);
    ("rejected", request_id, message);
    ("finished", output) for a request aborted outside a step (the metrics count it).
"""
from __future__ import annotations

import dataclasses

import logging
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ..config import EngineConfig
from ..engine.stats import EngineStats
from ..util import spare_final_collections

logger = logging.getLogger(__name__)

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
    window_blocks: tuple[int, ...] = (0,)  # per KV layer group: the most blocks one sequence holds (PoolShape)


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

        if cfg.kv_events_config is not None:  # each replica publishes on its own port (vLLM's offset)
            cfg = dataclasses.replace(cfg, kv_events_config=cfg.kv_events_config.for_rank(index))
        engine = LLMEngine(cfg)
    except Exception as e:  # a bad config or model: the front reports it and does not retry
        conn.send(("failed", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)))
        return
    s = engine.stats()
    conn.send(("ready", ReplicaInfo(os.getpid(), engine.model_name, engine.max_model_len, engine.rules.chars_per_token,
                                    s.kv.num_blocks, s.kv.block_size, engine.kv.enable_prefix_caching, s,
                                    engine.kv.shape.window_blocks)))
    ReplicaSink(engine, commands, conn).run()
    spare_final_collections()


class ReplicaSink:
    """The engine-core loop's source and sink in a replica: commands off the queue,
    results down the pipe (the front's supervisor thread reads it)."""

    def __init__(self, engine, commands: mp.Queue, conn: Connection) -> None:
        from ..engine.core_loop import EngineCoreLoop

        self.commands, self.conn = commands, conn
        self.parent = mp.parent_process()
        self.loop = EngineCoreLoop(engine, self, self)

    def run(self) -> None:
        try:
            self.loop.run(threading.Event())
        except (BrokenPipeError, EOFError, OSError):
            return  # the front closed its end: it is shutting down

    def get(self, timeout: float) -> tuple | None:
        try:
            cmd = self.commands.get(timeout=timeout) if timeout else self.commands.get_nowait()
        except queue.Empty:
            return None
        if cmd[0] == "stats":  # a metrics scrape: the walked figures, between two steps
            return ("call", lambda e: e.refresh_view(),
                    lambda view, ok: self.conn.send(("stats", view, self.loop.adds_applied)))
        return cmd

    def wants(self, request_id: str) -> bool:
        return True  # the front drops what a departed client's request still sends

    def rejected(self, request_id: str, error: ValueError) -> None:
        self.conn.send(("rejected", request_id, str(error)))

    def stepped(self, outputs: list, view: EngineStats, tokens_run: int, adds_applied: int,
                moved: list[str]) -> None:
        self.conn.send(("step", outputs, view, tokens_run, adds_applied, moved))

    def finished(self, output) -> None:
        self.conn.send(("finished", output))

    def idle(self, view: EngineStats, adds_applied: int) -> bool:
        self.conn.send(("stats", view, adds_applied))
        return self.parent is None or self.parent.is_alive()  # the server is gone (killed): nobody reads

    def died(self, error: BaseException) -> None:
        raise error  # a tensor-parallel rank died, or a bug: this process ends, the front restarts it

    def closed(self) -> None:
        self.loop.engine.close()


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
