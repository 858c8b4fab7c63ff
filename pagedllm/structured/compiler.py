"""Compiled grammars for structured outputs: compiled off the engine's thread, in a
worker process with a deadline, and cached by their key.

A request's grammar is a future: the engine queues the request at once, and the
scheduler admits it when the future is done (a cache hit is done already). A compile
that passes its deadline kills the worker (a new one starts for the next job), and fails
only the requests waiting for that grammar; the failure is cached like a success, so a
hostile schema sent again costs nothing.

Compiles are shared fairly between tenants (the server's API keys): each tenant's jobs wait
in a queue of its own, the queues take turns, and no tenant holds more than all workers but
one (on a server without keys, where everyone is one tenant, it may hold them all). A tenant that sends hostile schemas back to back (each up to the deadline) holds one
worker; another tenant's cold grammar starts on the next at once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..sampling_params import StructuredOutputsParams
from .spec import GrammarSpec, grammar_spec
from .compiling import compile_spec, error_message
from .frames import read_frame, write_frame

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT = 10.0     # seconds one compile may take (the worker is killed past it)
CACHE_ENTRIES = 128        # compiled grammars kept (each ~1 MB for a 49k vocabulary)
WORKERS = 2                # compiles at once: one slow grammar does not hold up the next


class GrammarError(ValueError):
    """The schema, regex or grammar cannot be compiled (the client's error: a 400)."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar as the runner's matchers use it (xgrammar's CompiledGrammar)."""
    key: tuple
    compiled: Any
    compile_seconds: float


@dataclass(slots=True)
class GrammarStats:
    """Counters since start (summed over data-parallel replicas by the front)."""
    requests: int = 0          # structured-output requests
    cache_queries: int = 0     # grammar lookups (one per request)
    cache_hits: int = 0        # of them, compiled already (or being compiled)
    compiles: int = 0          # compiles finished, good or bad
    compile_seconds: float = 0.0
    failures: int = 0          # compiles that failed (bad input, deadline)

    def merge(self, other: GrammarStats) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class _Worker:
    """One compiling process, started on first use, killed at a deadline."""

    def __init__(self, tokenizer_info: str) -> None:
        self._info = tokenizer_info
        self._proc: subprocess.Popen | None = None

    def run(self, spec: GrammarSpec, timeout: float) -> tuple[str | None, float]:
        """(the compiled grammar's JSON, or None for one to compile again here; seconds)."""
        proc = self._start()
        try:
            write_frame(proc.stdin, spec.key)
            answer = self._read(proc, timeout)
        except TimeoutError:  # first: it is an OSError too
            self.close()
            raise GrammarError(f"compiling the grammar took more than {timeout:g} s; simplify the schema, regex "
                               "or grammar") from None
        except (OSError, EOFError):
            self.close()
            raise GrammarError("the grammar compiler process died while compiling this request's grammar") from None
        if answer[0] == "error":
            raise GrammarError(f"structured_outputs.{spec.field or spec.kind}: {answer[1]}")
        return answer[1], answer[2]

    def start(self) -> None:
        self._start()

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            self._proc = subprocess.Popen([sys.executable, "-m", "pagedllm.structured.worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env, bufsize=0)
            write_frame(self._proc.stdin, self._info)
            self._read(self._proc, 120.0)  # ("ready",): imports and the tokenizer table
        return self._proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                return read_frame(_Exact(proc.stdout))

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


class _Exact:
    """read(n) that returns n bytes from an unbuffered pipe (or fewer only at its end)."""

    def __init__(self, raw) -> None:
        self._raw = raw

    def read(self, n: int) -> bytes:
        parts, left = [], n
        while left:
            chunk = self._raw.read(left)
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)


# Idle compiling processes by the digest of the tokenizer table they hold: the engines of
# one process (tests, benchmarks, an offline script with several LLMs) share them. A worker
# exits by itself when its parent does (its stdin closes).
_IDLE: dict[str, list[_Worker]] = {}
_MADE: dict[str, int] = {}   # workers made per digest, idle or busy
_IDLE_LOCK = threading.Lock()
_NONE = object()   # no tenant may start a job now


class GrammarCompiler:
    """Futures of compiled grammars by key, for the engine (thread-safe: the server's
    event loop checks a request's grammar before submitting it, the engine looks it up)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int] | frozenset[int],
                 timeout: float = COMPILE_TIMEOUT, cache_entries: int = CACHE_ENTRIES, workers: int = WORKERS) -> None:
        self._tokenizer, self._vocab_size, self._stops = tokenizer, vocab_size, sorted(stop_token_ids)
        self.timeout = timeout
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._max_entries = cache_entries
        self._lock = threading.Lock()
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None   # started on the first compile
        # Jobs not started, by tenant, the next to take its turn first; compiles running, by tenant.
        self._waiting: OrderedDict[str | None, deque[tuple[GrammarSpec, Future]]] = OrderedDict()
        self._running: dict[str | None, int] = {}
        self._per_tenant = max(1, workers - 1)
        self._info = None   # xgrammar's TokenizerInfo, built on the first compile
        self._info_lock = threading.Lock()
        self._here = threading.local()   # each compiling thread's own xgrammar compiler
        self.stats = GrammarStats()

    def submit(self, so: StructuredOutputsParams, count: bool = True, tenant: str | None = None) -> Future:
        """The grammar of `so`, compiled or being compiled. Raises ValueError at once for
        what the checks of spec.grammar_spec refuse; a compile error fails the future.
        `count`: the request's first lookup (a checked request's second is not counted).
        `tenant`: whose turn a new compile waits for (None: the server has no keys)."""
        spec = grammar_spec(so)
        with self._lock:
            self.stats.cache_queries += count
            fut = self._cache.get(spec.key)
            if fut is not None:
                self.stats.cache_hits += count
                self._cache.move_to_end(spec.key)
                return fut
            if self._pool is None:  # closed (an engine's close()): a later request starts it again
                self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="grammar")
            fut: Future = Future()
            self._waiting.setdefault(tenant, deque()).append((spec, fut))
            self._dispatch()
            self._cache[spec.key] = fut
            while len(self._cache) > self._max_entries:
                oldest = next(iter(self._cache))
                if not self._cache[oldest].done():
                    break
                del self._cache[oldest]
            return fut

    def _dispatch(self) -> None:
        """Start waiting jobs on free workers, the tenants in turn (the lock held)."""
        while self._pool is not None and sum(self._running.values()) < self._workers:
            tenant = next((t for t in self._waiting if self._running.get(t, 0) < self._share(t)), _NONE)
            if tenant is _NONE:
                return
            queue = self._waiting.pop(tenant)
            spec, fut = queue.popleft()
            if queue:
                self._waiting[tenant] = queue   # at the back: the others' turn first
            self._running[tenant] = self._running.get(tenant, 0) + 1
            self._pool.submit(self._run, spec, fut, tenant)

    def _share(self, tenant: str | None) -> int:
        """The workers a tenant may hold: all but one, so that another tenant's compile always
        finds one; all of them on a server without keys (tenant None: everyone is one tenant)."""
        return self._workers if tenant is None else self._per_tenant

    def _run(self, spec: GrammarSpec, fut: Future, tenant: str | None) -> None:
        try:
            fut.set_result(self._compile(spec))
        except BaseException as e:   # the future carries it to whoever waits
            fut.set_exception(e)
        finally:
            with self._lock:
                self._running[tenant] -= 1
                if not self._running[tenant]:
                    del self._running[tenant]
                self._dispatch()

    def compile(self, so: StructuredOutputsParams) -> Grammar:
        """Blocking: the compiled grammar, or GrammarError/ValueError naming the problem."""
        return self.submit(so).result()

    def count_request(self) -> None:
        with self._lock:
            self.stats.requests += 1

    def tokenizer_info(self):
        with self._info_lock:
            if self._info is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                                stop_token_ids=self._stops)
                # What a worker is started with, and the key its idle peers are shared by:
                # serialized once (1.6 MB for a 49k vocabulary), not on every compile.
                self._table = self._info.serialize_json()
                self._digest = hashlib.blake2b(self._table.encode(), digest_size=16).hexdigest()
                threading.Thread(target=self._start_workers, name="grammar-workers", daemon=True).start()
            return self._info

    def _start_workers(self) -> None:
        """Start all the workers now, in the background: a worker starts in about a second
        (imports, the tokenizer table), and the second compile at once (one tenant's slow
        schema beside another's) should not pay that."""
        while True:
            with _IDLE_LOCK:
                if _MADE.get(self._digest, 0) >= self._workers:
                    return
                _MADE[self._digest] = _MADE.get(self._digest, 0) + 1
            worker = _Worker(self._table)
            try:
                worker.start()
            except (OSError, EOFError, TimeoutError):
                logger.warning("a grammar compiling process did not start; one will be started when needed")
            with _IDLE_LOCK:
                _IDLE.setdefault(self._digest, []).append(worker)

    def _compile(self, spec: GrammarSpec) -> Grammar:
        import xgrammar as xgr

        info = self.tokenizer_info()
        with _IDLE_LOCK:
            idle = _IDLE.setdefault(self._digest, [])
            worker = idle.pop() if idle else None
        if worker is None:
            worker = _Worker(self._table)
            with _IDLE_LOCK:
                _MADE[self._digest] = _MADE.get(self._digest, 0) + 1
        t0 = time.perf_counter()
        try:
            data, _ = worker.run(spec, self.timeout)
            compiled = self._compile_here(spec) if data is None else xgr.CompiledGrammar.deserialize_json(data, info)
            grammar = Grammar(spec.key, compiled, time.perf_counter() - t0)
        except GrammarError:
            self._count(time.perf_counter() - t0, failed=True)
            raise
        finally:
            with _IDLE_LOCK:
                idle.append(worker)
        self._count(grammar.compile_seconds, failed=False)
        return grammar

    def _compile_here(self, spec: GrammarSpec):
        """A spec the worker compiled within worker.REBUILD_SECONDS, compiled again in this
        process: never one it has not compiled in time and in memory first. One xgrammar
        compiler per compiling thread (xgrammar does not promise that one compiler may
        compile on several threads at once)."""
        import xgrammar as xgr

        here = getattr(self._here, "compiler", None)
        if here is None:
            here = self._here.compiler = xgr.GrammarCompiler(self.tokenizer_info(), max_threads=1,
                                                             cache_enabled=False)
        try:
            return compile_spec(here, *spec.key)
        except Exception as e:  # it compiled in the worker: not the client's error, but say what
            raise GrammarError(f"structured_outputs.{spec.field or spec.kind}: {error_message(e)}") from e

    def _count(self, seconds: float, failed: bool) -> None:
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += seconds
            self.stats.failures += failed

    def snapshot(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(**{n: getattr(self.stats, n) for n in GrammarStats.__slots__})

    def close(self) -> None:
        """Stop compiling for this engine (the idle workers stay for the process's others);
        a request after it starts again."""
        with self._lock:
            pool, self._pool = self._pool, None
            waiting, self._waiting = self._waiting, OrderedDict()
            for queue in waiting.values():   # never started: their requests fail, as a cancelled job's did
                for spec, fut in queue:
                    self._cache.pop(spec.key, None)
                    fut.cancel()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
