"""DataParallelEngine: N replica processes behind one EngineClient (pagedllm.engine.client),
the interface AsyncLLMEngine gives the server too.

The server's event loop validates a request (the engines' RequestRules, in this process),
asks the Router for a replica and puts the request on that replica's queue. One supervisor thread per replica reads its
pipe: outputs go to the request streams and the metrics observer; when the pipe ends (the
process died) the replica's requests in flight fail with EngineDeadError at once, and a
new process takes the same index, so the hash ring, and the other replicas, are untouched;
the router forgets what it sent the dead one, whose successor starts with an empty pool.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from ..config import EngineConfig
from ..engine.async_engine import _Stream, read_stream
from ..engine.client import EngineDeadError, EngineInfo, QueueFullError, StepObserver, failure
from ..engine.validation import RequestRules
from ..kv import PoolShape
from ..loader import load_config, load_tokenizer, resolve_model_dir
from ..models import ModelConfig
from ..engine.stats import EngineStats
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, StructuredOutputsParams
from ..structured import GrammarCompiler, mark_checked
from .replica import ReplicaInfo, replica_main, wait_ready
from .router import MAX_RECORD_BLOCKS, ReplicaLoad, Router
from .stats import ReplicaFigures, counters_only, grammar_total, sum_stats, zero_stats

logger = logging.getLogger(__name__)

START_TIMEOUT = 600.0        # seconds a replica may take to load its model
MAX_RESTART_FAILURES = 5     # consecutive failed restarts before a replica is given up
RESTART_BACKOFF = 1.0        # seconds before the 2nd try, doubling after each failure


@dataclass
class Replica:
    """The front's view of one replica process; fields change only under the front's lock."""
    index: int
    proc: mp.process.BaseProcess | None = None
    commands: mp.Queue | None = None
    conn: Connection | None = None
    info: ReplicaInfo | None = None
    stats: EngineStats | None = None
    alive: bool = False
    streams: dict[str, _Stream] = field(default_factory=dict)  # its requests in flight
    adds_sent: int = 0
    adds_applied: int = 0
    restarts: int = 0
    routed: int = 0   # requests sent to it, over the server's life
    fresh: threading.Event = field(default_factory=threading.Event)  # set by its next walked figures

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(len(self.streams), self.stats.kv.usage if self.stats else 0.0, self.alive)


class DataParallelEngine:
    def __init__(self, cfg: EngineConfig, max_queue_len: int | None = None, log_interval: float = 10.0,
                 log_level: str = "INFO") -> None:
        n = cfg.data_parallel_size
        if cfg.num_threads is None:  # share the cores: each replica steps its own batch
            from ..runtime.threads import resolve_num_threads
            cfg = replace(cfg, num_threads=max(1, resolve_num_threads(None)[0] // n))
        self.cfg, self.max_queue_len, self.log_interval, self.log_level = cfg, max_queue_len, log_interval, log_level
        self.replicas = [Replica(i) for i in range(n)]
        self.observer: StepObserver | None = None
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._retired = zero_stats(cfg.block_size)  # counters of replicas that died
        # Converts or downloads the model once, here, not in N processes at the same time;
        # the tokenizer and model config load while the replicas load their weights.
        model_dir = resolve_model_dir(cfg.model)
        model_cfg = ModelConfig.from_hf(load_config(model_dir))
        tokenizer = load_tokenizer(model_dir if cfg.tokenizer is None else resolve_model_dir(cfg.tokenizer),
                                   cfg.chat_template)
        for r in self.replicas:
            self._spawn(r)
        try:
            infos = [self._await_ready(r) for r in self.replicas]
        except ValueError:
            self.shutdown()
            raise
        self.info = _front_info(cfg, model_dir, model_cfg, tokenizer, infos)
        self.grammars = GrammarCompiler(tokenizer, model_cfg.vocab_size, model_cfg.stop_ids(tokenizer),
                                        timeout=cfg.grammar_compile_timeout)
        # A record larger than a replica's pool would remember blocks the replica has reused.
        self.router = Router(n, cfg.router_policy, cfg.block_size,
                             record_blocks=min(MAX_RECORD_BLOCKS, min(i.num_blocks for i in infos)))
        self._threads = [threading.Thread(target=self._supervise, args=(r,), name=f"pagedllm-dp{r.index}",
                                          daemon=True) for r in self.replicas]
        self._threads.append(threading.Thread(target=self._log_loop, name="pagedllm-dp-log", daemon=True))
        for t in self._threads:
            t.start()
        logger.info("data parallel: %d replicas (pids %s), %d threads each, router %s", n,
                    ", ".join(str(i.pid) for i in infos), cfg.num_threads, cfg.router_policy)

    # -- the server's interface (AsyncLLMEngine's) ---------------------------
    @property
    def alive(self) -> bool:
        return not self._stop.is_set() and any(r.alive for r in self.replicas)

    @property
    def stats(self) -> EngineStats:
        """The totals: counters of every replica that ever ran, gauges of the live ones."""
        with self._lock:
            total = sum_stats([self._retired] + [r.stats for r in self.replicas if r.stats is not None])
        front = self.grammars.snapshot()  # the lookups the front made (its checks)
        total.grammar = grammar_total([total.grammar, replace(front, requests=0, compiles=0, compile_seconds=0.0)])
        return total

    def replica_figures(self) -> list[ReplicaFigures]:
        """Each replica's state now, for the metrics and the status line."""
        with self._lock:
            return [ReplicaFigures(r.index, r.alive, r.restarts, r.routed, r.stats, len(r.streams))
                    for r in self.replicas]

    def validate(self, prompt: str | Seq[int], params: SamplingParams, add_special_tokens: bool = True) -> list[int]:
        """By the engines' own rules, here: the smallest replica's pool decides what can ever fit."""
        return self.info.rules.validate(prompt, params, add_special_tokens)

    async def check_structured(self, so: StructuredOutputsParams, tenant: str | None = None) -> None:
        """Compiled here to refuse a bad grammar with a 400 (the replica compiles its own,
        off its engine thread; the front's figures count the lookups, the replicas' the requests)."""
        await asyncio.wrap_future(self.grammars.submit(so, tenant=tenant))
        mark_checked(so)

    async def get_stats(self, timeout: float = 2.0) -> EngineStats:
        """The totals with every live replica's KV slot figures walked now: each is asked
        between two of its steps; one that does not answer in time keeps its latest."""
        with self._lock:
            asked = [r for r in self.replicas if r.alive and r.commands is not None]
            for r in asked:
                r.fresh.clear()
        for r in asked:
            _put(r.commands, ("stats",))
        deadline = time.monotonic() + timeout
        for r in asked:
            await asyncio.to_thread(r.fresh.wait, max(0.0, deadline - time.monotonic()))
        return self.stats

    def submit(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
               cache_salt: str | None = None, owner: str | None = None,
               priority: int = 0, lora_request=None) -> AsyncIterator[RequestOutput]:
        """As AsyncLLMEngine.submit: raises at once, or returns the request's stream. Adapters
        are refused at start under data parallelism (server/lora.py), so none arrives here."""
        if not self.alive:
            raise EngineDeadError("no data-parallel replica is running")
        ids = self.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self.max_queue_len is not None and self._queued() >= self.max_queue_len:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); retry later")
            try:
                r = self.replicas[self.router.choose(ids, cache_salt, [x.load() for x in self.replicas])]
            except ValueError:
                raise EngineDeadError("no data-parallel replica is running") from None
            r.streams[request_id] = stream
            r.adds_sent += 1
            r.routed += 1
            commands = r.commands
        _put(commands, ("add", request_id, ids, params, cache_salt, owner, priority, None))
        return self._iterate(r, request_id, stream)

    async def generate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.submit(request_id, prompt, params, cache_salt):
            yield out

    def wake(self) -> None:
        """Nothing to wake: replicas wait on their queues (AsyncLLMEngine's interface)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:  # no restart starts after this
            self._stop.set()
        if hasattr(self, "grammars"):
            self.grammars.close()
        for r in self.replicas:
            if r.commands is not None:
                _put(r.commands, ("stop",))
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            if r.proc is not None:
                r.proc.join(max(0.1, deadline - time.monotonic()))
                if r.proc.is_alive():
                    r.proc.kill()  # replicas ignore SIGTERM: their lifetime is ours
                    r.proc.join(5)
            self._fail(r, EngineDeadError("the server is shutting down"))
            if r.commands is not None:
                r.commands.cancel_join_thread()  # a dead reader must not hang our exit

    # -- requests ------------------------------------------------------------
    def _queued(self) -> int:
        """Requests waiting in the live replicas or on their way there (caller holds the lock)."""
        return sum((r.stats.num_waiting if r.stats else 0) + r.adds_sent - r.adds_applied
                   for r in self.replicas if r.alive)

    def _iterate(self, r: Replica, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        def leave(finished: bool) -> None:
            if finished:
                return
            with self._lock:  # the client left: free its blocks, if its replica still has it
                mine = r.streams.pop(request_id, None) is stream
                commands = r.commands
            if mine:
                _put(commands, ("abort", request_id))
        return read_stream(stream, leave)

    def _deliver(self, r: Replica, out: RequestOutput) -> None:
        with self._lock:
            stream = r.streams.pop(out.request_id, None) if out.finished else r.streams.get(out.request_id)
        if stream is not None:
            item = out if out.error is None else failure(out)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail(self, r: Replica, error: BaseException) -> None:
        with self._lock:
            streams, r.streams = r.streams, {}
        for stream in streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    # -- replica processes ---------------------------------------------------
    def _spawn(self, r: Replica) -> bool:
        """Start r's process (False when the front is shutting down)."""
        if r.conn is not None:  # a dead predecessor's
            r.conn.close()
            r.commands.cancel_join_thread()
            r.commands.close()
        ours, theirs = self._ctx.Pipe(duplex=False)
        commands = self._ctx.Queue()
        proc = self._ctx.Process(target=replica_main, args=(r.index, self.cfg, commands, theirs, self.log_level),
                                 name=f"pagedllm-replica{r.index}", daemon=True)
        with self._lock:  # shutdown() sees every process started, or none starts
            if self._stop.is_set():
                return False
            proc.start()
            r.proc, r.commands, r.conn = proc, commands, ours
            r.adds_sent = r.adds_applied = 0
        theirs.close()  # ours alone now: its end of file is the replica's death
        return True

    def _await_ready(self, r: Replica) -> ReplicaInfo:
        try:
            info = wait_ready(r.conn, r.proc, START_TIMEOUT, self._stop)
        except ValueError as e:
            raise ValueError(f"data-parallel replica {r.index}: {e}") from None
        with self._lock:
            r.info, r.stats, r.alive = info, info.stats, True
        return info

    def _supervise(self, r: Replica) -> None:
        """Read this replica's pipe; when it ends, fail its requests and start a new process."""
        while not self._stop.is_set():
            self._pump(r)
            if self._stop.is_set():
                return
            r.proc.join(5)
            code = r.proc.exitcode
            logger.error("data-parallel replica %d (pid %s) died (exit code %s); restarting it", r.index,
                         r.proc.pid, code)
            with self._lock:
                r.alive = False
                self.router.forget(r.index)
                if r.stats is not None:
                    self._retired = sum_stats([self._retired, counters_only(r.stats)])
                    r.stats = None
            self._fail(r, EngineDeadError(f"data-parallel replica {r.index} died (exit code {code}); "
                                          "this request failed, the others are unaffected: retry it"))
            if not self._restart(r):
                return

    def _restart(self, r: Replica) -> bool:
        for failures in range(MAX_RESTART_FAILURES):
            if failures:
                self._stop.wait(RESTART_BACKOFF * 2 ** (failures - 1))
            if not self._spawn(r):
                return False
            try:
                info = self._await_ready(r)
            except ValueError as e:
                if self._stop.is_set():
                    return False
                logger.error("%s", e)
                continue
            with self._lock:
                r.restarts += 1
            logger.info("data-parallel replica %d is back (pid %d)", r.index, info.pid)
            return True
        logger.error("data-parallel replica %d failed to restart %d times; giving it up", r.index,
                     MAX_RESTART_FAILURES)
        return False

    def _pump(self, r: Replica) -> None:
        """Handle the replica's messages until its pipe ends."""
        while True:
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "step":
                _, outs, stats, ran, applied, moved = msg
                with self._lock:  # the counters before the outputs: an answered request is counted
                    r.stats, r.adds_applied = stats, applied
                self._observe("on_step", outs, ran, moved)
                for out in outs:
                    self._deliver(r, out)
            elif kind == "stats":
                with self._lock:
                    r.stats, r.adds_applied = msg[1], msg[2]
                r.fresh.set()
            elif kind == "finished":  # aborted outside a step, or failed with its step
                self._observe("on_finished", msg[1])
                self._deliver(r, msg[1])
            elif kind == "rejected":
                with self._lock:
                    stream = r.streams.pop(msg[1], None)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ValueError(msg[2]))

    def _observe(self, method: str, *args) -> None:
        if self.observer is None:
            return
        try:  # a metrics bug must not stop the replica's outputs
            getattr(self.observer, method)(*args)
        except Exception:
            logger.exception("metrics observer failed")

    def _log_loop(self) -> None:
        """One status line per interval while anything moves: totals, then each replica."""
        last = self.stats
        while not self._stop.wait(self.log_interval):
            s = self.stats
            if s.steps == last.steps and not s.num_running and not s.num_waiting:
                continue
            q, h = s.kv.prefix_queries - last.kv.prefix_queries, s.kv.prefix_hits - last.kv.prefix_hits
            parts = [f"[{r.index}] {'up' if r.alive else 'DOWN'} {r.in_flight} in flight, "
                     f"KV {100 * r.stats.kv.usage if r.stats else 0:.0f}%" for r in self.replica_figures()]
            logger.info("running: %d reqs, waiting: %d reqs, KV usage: %.1f%%, prefix hit rate: %.1f%%, "
                        "generation: %.1f tok/s; replicas: %s", s.num_running, s.num_waiting, 100 * s.kv.usage,
                        100 * h / q if q else 0.0, (s.generation_tokens - last.generation_tokens) / self.log_interval,
                        ", ".join(parts))
            last = s


def _put(commands: mp.Queue, cmd: tuple) -> None:
    """Queue a command; a queue closed under us belonged to a replica that died, whose
    requests have had their EngineDeadError already."""
    try:
        commands.put(cmd)
    except (ValueError, OSError):
        pass


def _front_info(cfg: EngineConfig, model_dir, model_cfg: ModelConfig, tokenizer,
                infos: list[ReplicaInfo]) -> EngineInfo:
    """What the server reads of the engines, from the started replicas': their limits, and
    the request rules over the smallest pool (as large as the one a request may land in)."""
    info = infos[0]
    shape = PoolShape.of(min(i.num_blocks for i in infos), info.block_size, cfg.allocation, info.max_model_len,
                         info.window_blocks)
    rules = RequestRules(tokenizer, model_cfg.vocab_size, info.max_model_len, cfg.max_num_seqs, shape,
                         cfg.max_logprobs, info.chars_per_token)
    tokenizer_dir = model_dir if cfg.tokenizer is None else resolve_model_dir(cfg.tokenizer)
    return EngineInfo(info.model_name, cfg.model, tokenizer, rules, info.max_model_len, info.block_size,
                      shape.num_blocks, info.enable_prefix_caching, cfg, model_dir, tokenizer_dir,
                      model_cfg.model_type)
