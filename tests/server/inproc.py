"""A server in this process, reached through httpx.ASGITransport: the app `pagedllm serve` would
run (the same flags, server.launch.build), with no socket and no process of its own.

ASGITransport is asynchronous; the app runs on an event loop in a thread of its own (the async
engine hands its outputs to that loop, as under uvicorn), and SyncASGITransport lets the tests'
synchronous httpx and openai clients call it. A response comes back whole, streams included
(their events in order): what a client that reads to the end sees. Tests whose point is the
socket (slow clients, disconnects, shutdown, the browser) keep a real server process."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx

from hw import FAST_DTYPE

# The dtype the CPU runs fast (bf16 where it has bf16 instructions, else fp32): the in-process
# servers' answers are held to offline engines of the same dtype; what is held to HF
# transformers' float32 runs on fp32_server.
BASE = ("--dtype", FAST_DTYPE, "--kv-cache-memory", "160MiB", "--max-model-len", "1024", "--log-interval", "2")
URL = "http://inproc"


class SyncASGITransport(httpx.BaseTransport):
    def __init__(self, app, loop: asyncio.AbstractEventLoop, timeout: float = 300) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.loop, self.timeout = loop, timeout

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def call() -> tuple[int, httpx.Headers, bytes]:
            req = httpx.Request(request.method, request.url, headers=request.headers, content=body)
            resp = await self.inner.handle_async_request(req)
            return resp.status_code, resp.headers, await resp.aread()
        status, headers, content = asyncio.run_coroutine_threadsafe(call(), self.loop).result(self.timeout)
        return httpx.Response(status, headers=headers, content=content, request=request)


@dataclasses.dataclass
class InProcessServer:
    built: object                 # server.launch.Built
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    url: str = URL

    @property
    def transport(self) -> SyncASGITransport:
        return SyncASGITransport(self.built.app, self.loop)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(transport=self.transport, base_url=self.url, **kw)

    def openai(self, api_key: str = "none", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, http_client=self.client(), **kw)

    def anthropic(self, api_key: str = "none", **kw):
        """The anthropic client, whose HTTP library is httpx2 (a transport of its own kind)."""
        import anthropic
        import httpx2

        http = httpx2.Client(transport=Httpx2Transport(self.transport), base_url=self.url, timeout=300)
        return anthropic.Anthropic(base_url=self.url, api_key=api_key, http_client=http, **kw)

    def async_openai(self, api_key: str = "none", **kw):
        import openai

        http = httpx.AsyncClient(transport=AsyncASGITransport(self.built.app, self.loop), base_url=self.url)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, http_client=http, **kw)

    @property
    def engine(self):
        return self.built.async_engine

    def close(self) -> None:
        if self.built.attached is not None:
            self.built.attached.close()
        self.built.async_engine.shutdown()
        if self.built.state.tracer is not None:
            self.built.state.tracer.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def serve_in_process(*flags: str, engine=None) -> InProcessServer:
    """The app of `pagedllm serve BASE... flags...`, on `engine` if given (an LLMEngine whose
    config matches the flags' engine part: a test shares one model load across servers)."""
    from pagedllm.cli import _viz_attach, build_parser, engine_config
    from pagedllm.server.launch import ServerOptions, build

    args = build_parser().parse_args(["serve", *BASE, *flags])
    cfg = engine_config(args)
    opts = ServerOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)})
    attach = _viz_attach(args, cfg, 0.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="inproc-server", daemon=True)
    thread.start()
    # The app's state makes asyncio objects: build it on the loop that will serve it.
    built = asyncio.run_coroutine_threadsafe(_build(build, cfg, opts, attach, engine), loop).result(300)
    return InProcessServer(built, loop, thread)


async def _build(build, cfg, opts, attach, engine):
    return build(cfg, opts, attach, engine=engine)


class AsyncASGITransport(httpx.AsyncBaseTransport):
    """For async clients on an event loop of their own (the openai-agents SDK's): each request
    runs on the server's loop and is awaited from the caller's."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop) -> None:
        self.inner, self.loop = SyncASGITransport(app, loop), loop

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        sync = httpx.Request(request.method, request.url, headers=request.headers, content=body)
        resp = await asyncio.get_running_loop().run_in_executor(None, self.inner.handle_request, sync)
        return httpx.Response(resp.status_code, headers=resp.headers, content=resp.content, request=request)


def Httpx2Transport(inner: SyncASGITransport):
    """SyncASGITransport for clients built on httpx2 (the anthropic client's)."""
    import httpx2

    class Transport(httpx2.BaseTransport):
        def handle_request(self, request):
            sync = httpx.Request(request.method, str(request.url), headers=request.headers.raw, content=request.read())
            resp = inner.handle_request(sync)
            return httpx2.Response(resp.status_code, headers=resp.headers.raw, content=resp.content, request=request)
    return Transport()
