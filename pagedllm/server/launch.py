"""A server put together and run: the engine (one, or N data-parallel replicas), the app,
a watchdog that ends the server when the engine can never step again, and uvicorn with
our graceful shutdown. The CLI parses the flags and calls `serve`.

Something that watches the one engine and brings routes of its own (the visualizer) is
handed in as an `Attach` hook: the server calls it at fixed points and imports nothing
of it, so the arrow runs from the visualizer to the server. ServerOptions is declared in
server/options.py, which the CLI reads at parse time without this module's imports."""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG

from ..config import EngineConfig
from ..engine.async_engine import AsyncLLMEngine
from ..engine.core_loop import StepGate, is_fatal
from ..engine.engine import LLMEngine
from .api import create_app
from .http import ConcurrencyLimit, GracefulShutdown, timed_h11
from .lora import RUNTIME_FLAG, parse_lora_modules, runtime_updates_allowed, served_loras
from .options import ServerOptions
from .responses.store import ResponseStore
from .state import ServerState

logger = logging.getLogger(__name__)


class Attachment(Protocol):
    """A watcher of the served engine with routes of its own (the visualizer, viz/mount.py)."""
    path: str  # where its page is, for the start-up line

    @property
    def gate(self) -> StepGate:
        """Gates the async engine's steps (pause, single step, delay)."""

    def bind(self, async_engine: AsyncLLMEngine) -> None:
        """Called once the async engine exists (its wake())."""

    def mount(self, app: FastAPI, state: ServerState) -> None:
        """Add its routes to the app."""

    def close(self) -> None:
        """At the shutdown signal, before the drain: end the streams it holds open."""


Attach = Callable[[LLMEngine], Attachment]  # called on the engine before it serves
OnStart = Callable[[ServerState, Attachment | None], Awaitable[None]]


def api_keys(given: list[str] | None) -> list[str]:
    keys = list(given or [])
    if not keys and os.environ.get("PAGEDLLM_API_KEY"):
        keys = [k for k in os.environ["PAGEDLLM_API_KEY"].split(",") if k]
    return keys


@dataclass
class Built:
    """A server's parts before it listens: the engine it talks to, its state, its app, and
    what was attached to the engine."""
    async_engine: AsyncLLMEngine
    state: ServerState
    app: FastAPI
    attached: Attachment | None = None


def build(cfg: EngineConfig, opts: ServerOptions, attach: Attach | None = None,
          engine: LLMEngine | None = None) -> Built:
    """The engine (`engine`, or one built from cfg; N replicas under data parallelism), its
    state and the app, not yet served: `serve` runs it under uvicorn; the tests drive it in
    process (httpx.ASGITransport). ValueError for a bad setting."""
    keys = api_keys(opts.api_key)
    isolation = opts.prefix_cache_isolation or ("per-key" if keys else "none")
    if opts.enable_auto_tool_choice and opts.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the parser that reads calls from "
                         "the model's text)")
    parse_lora_modules(opts.lora_modules)   # a malformed flag stops the start before any model loads
    if opts.lora_modules and not cfg.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    async_engine, attached = _engines(cfg, opts, attach, engine)
    try:
        name = opts.served_model_name or async_engine.info.model_name
        state = ServerState(async_engine, name, keys, isolation, opts.max_body_bytes,
                            admin_key=opts.admin_key or os.environ.get("PAGEDLLM_ADMIN_KEY") or None,
                            body_timeout=opts.body_timeout, metrics_prefix=opts.metrics_prefix,
                            tool_call_parser=opts.tool_call_parser if opts.enable_auto_tool_choice else None,
                            reasoning_parser=opts.reasoning_parser)
        state.loras = served_loras(async_engine.info, name, opts.lora_modules)
        if runtime_updates_allowed() and keys and state.admin_key is None:
            logger.warning("%s=True, but runtime adapter loads and unloads stay refused: this server has API keys "
                           "and no --admin-key (or PAGEDLLM_ADMIN_KEY), and an adapter changes what every tenant "
                           "is served; give an admin key to allow them to its holder", RUNTIME_FLAG)
        state.responses = ResponseStore(opts.max_stored_responses)
        if opts.otlp_traces_endpoint:
            from .tracing import Observers, RequestTracer

            state.tracer = RequestTracer(opts.otlp_traces_endpoint, name)
            async_engine.observer = Observers(state.metrics, state.tracer)
    except ValueError:
        async_engine.shutdown()
        raise
    app = create_app(state)
    if attached is not None:
        attached.mount(app, state)
    return Built(async_engine, state, app, attached)


def serve(cfg: EngineConfig, opts: ServerOptions, attach: Attach | None = None,
          on_start: OnStart | None = None) -> int:
    """Build the engine and serve it until a signal, or until the engine can never step
    again. `attach` is called on a single engine only (data parallelism has none to
    watch); on_start(state, attachment) runs as a task once serving. Returns the exit
    code: 0 stopped, 1 the engine failed, 2 a bad setting."""
    try:
        built = build(cfg, opts, attach)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    async_engine, state, app, attached = built.async_engine, built.state, built.app, built.attached
    server = _uvicorn_server(app, state, opts, attached)
    fatal: list[BaseException] = []

    def stop(err: BaseException) -> None:
        fatal.append(err)
        server.handle_exit(signal.SIGTERM, None)  # the extended handler, as a SIGTERM would

    app.router.lifespan_context = _lifespan(state, async_engine, attached, on_start, stop)
    logger.info("serving %s on http://%s:%d (API keys: %d, prefix-cache isolation: %s, visualizer: %s)",
                state.model_name, opts.host, opts.port, len(state.api_keys), state.isolation,
                f"http://{opts.host}:{opts.port}{attached.path}" if attached else "off")
    server.run()
    if fatal:
        print(f"error: the engine failed: {fatal[0]}", file=sys.stderr)
        return 1
    logger.info("server stopped")
    return 0


def _engines(cfg: EngineConfig, opts: ServerOptions, attach: Attach | None, engine: LLMEngine | None = None):
    """The async engine the server talks to (N replica processes behind one front under
    data parallelism), and what was attached to the single engine."""
    if cfg.data_parallel_size > 1 and engine is None:
        from ..dp.front import DataParallelEngine

        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        return DataParallelEngine(cfg, opts.max_queue_len, opts.log_interval, level), None
    engine = engine or LLMEngine(cfg)
    attached = attach(engine) if attach is not None else None
    async_engine = AsyncLLMEngine(engine, opts.max_queue_len, opts.log_interval,
                                  gate=attached.gate if attached is not None else None)
    if attached is not None:
        attached.bind(async_engine)
    return async_engine, attached


async def _watch_engine(async_engine, stop: Callable[[BaseException], None]) -> None:
    """An engine that can never step again (a tensor-parallel rank died) ends the
    server, with its error, rather than answer 503 for ever."""
    while (err := getattr(async_engine, "error", None)) is None or not is_fatal(err):
        await asyncio.sleep(0.5)
    logger.error("stopping the server: %s", err)
    stop(err)


def _lifespan(state: ServerState, async_engine, attached: Attachment | None, on_start: OnStart | None,
              stop: Callable[[BaseException], None]):
    @asynccontextmanager
    async def lifespan(_app):
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(_watch_engine(async_engine, stop))]
        if on_start:
            tasks.append(loop.create_task(on_start(state, attached)))
        yield
        for task in tasks:
            task.cancel()
        async_engine.shutdown()  # after uvicorn drained (or gave up on) in-flight requests
        if state.tracer is not None:
            state.tracer.shutdown()   # the last spans out
    return lifespan


def _uvicorn_server(app: FastAPI, state: ServerState, opts: ServerOptions,
                    attached: Attachment | None) -> uvicorn.Server:
    """uvicorn around the app and its HTTP guards, its exit handler extended with ours."""
    asgi = ConcurrencyLimit(app, opts.limit_concurrency) if opts.limit_concurrency else app
    shutdown = GracefulShutdown(asgi, state.closing, opts.graceful_shutdown_timeout)
    # uvicorn's own graceful timeout is the backstop: it cancels what is left, tearing
    # streams. It starts a moment after the signal; ours ends them cleanly first, and
    # the margin lets their last events go out and their connections close.
    config = uvicorn.Config(shutdown, host=opts.host, port=opts.port, log_level=opts.log_level.lower(),
                            timeout_graceful_shutdown=opts.graceful_shutdown_timeout + 5, access_log=False,
                            http=timed_h11(opts.header_timeout, opts.body_timeout), log_config=_uvicorn_logging())
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal against the
    # handler it found installed; a no-op one here lets a graceful shutdown exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = uvicorn.Server(config)
    exit_handler = server.handle_exit

    def handle_exit(sig, frame) -> None:
        if attached is not None:  # open pages hold event streams: end them first, or shutdown waits on them
            attached.close()
        shutdown.begin()
        exit_handler(sig, frame)
    server.handle_exit = handle_exit
    return server


def _uvicorn_logging() -> dict:
    """uvicorn's own logging config with our timestamps, so its lines and ours read alike."""
    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
    return config
