"""HTTP-level guards around the app: read deadlines, a concurrency limit, a graceful cut.

uvicorn has no deadline on reading a request: a client may send its headers or body a
byte a minute and hold a connection (and, mid-body, a request task) for as long as it
likes. And on SIGTERM it drains in-flight requests for its graceful timeout and then
cancels them, which tears a running stream off mid-body. These pieces close those gaps:

- `timed_h11(header_timeout, body_timeout)`: uvicorn's h11 protocol with deadlines on
  the request's headers and on a body the app left unread.
- `ConcurrencyLimit`: beyond N /v1/ requests in flight, an OpenAI-shaped 503 at once.
- `GracefulShutdown`: `grace` seconds after the signal, set `closing` (running streams
  end themselves with an error event and `data: [DONE]`, see `until_closing`) and answer
  503 to requests that have not started a response.
- `until(items, stop, error)`: an async generator's items until an awaitable completes.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

T = TypeVar("T")
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CLOSING_MESSAGE = "the server is shutting down; retry on another replica or later"


def error_body(status: int, message: str, type_: str) -> bytes:
    """OpenAI's error shape, as the app's own errors have it."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}},
                      separators=(",", ":")).encode()


async def send_error(send: Send, status: int, message: str, type_: str, close: bool = False) -> None:
    body = error_body(status, message, type_)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# -- read deadlines ------------------------------------------------------------
class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with two deadlines on the client:

    - headers: a new connection, or a kept-alive one from the first byte of its next
      request, must deliver complete request headers within `header_timeout`; else it
      gets a 408 (when part of a request came) and is closed. uvicorn's keep-alive timer
      still closes connections that stay silent between requests.
    - body: within `body_timeout` of its headers a request's body must be in. The app
      enforces this on the bodies it reads (`ServerState.read_json` answers 408); here
      a connection whose response is done while its body still trickles in is closed
      once the deadline has passed, so an answered request cannot hold it either.
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timing: str | None = None  # "headers" or "body": what the timer waits for
        self._body_late = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()  # always: a pending timer would pin this connection (uvicorn's own leaks so on a reset)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next (pipelined) request
        if self._body_late and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._close()
            return
        self._follow()

    def _follow(self) -> None:
        """Point the timer at what the client owes now."""
        state = self.conn.their_state
        if state is h11.IDLE:
            # Between requests nothing is owed (keep-alive handles silence) until bytes come.
            if self._timing != "headers" and self.conn.trailing_data[0]:
                self._arm("headers")
        elif state is h11.SEND_BODY:
            if self._timing != "body":
                self._body_late = False
                self._arm("body")
        elif self._timing is not None:
            self._disarm()

    def _arm(self, what: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        delay = self.header_timeout if what == "headers" else self.body_timeout
        self._timer = self.loop.call_later(delay, self._expired)
        self._timing = what

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timing = None, None

    def _expired(self) -> None:
        what, self._timer, self._timing = self._timing, None, None
        if self.transport.is_closing():
            return
        if what == "headers" and self.conn.their_state is h11.IDLE:
            logger.info("closing a connection from %s: no complete request headers within %g s",
                        _peer(self.client), self.header_timeout)
            if self.conn.trailing_data[0]:  # part of a request came: it may still read an answer
                self._send_408(f"request headers not received within {self.header_timeout:g} s")
            self._close()
        elif what == "body" and self.conn.their_state is h11.SEND_BODY:
            self._body_late = True
            if self.cycle is None or self.cycle.response_complete:
                self._close()
            # else the app is answering (a body it reads ends in its own 408); closed after

    def _send_408(self, message: str) -> None:
        body = error_body(408, message, "invalid_request_error")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # a response is under way: closing is all that is left
            return
        self.transport.write(out)

    def _close(self) -> None:
        self._disarm()
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()


def timed_h11(header_timeout: float, body_timeout: float) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...): uvicorn builds it with fixed
    arguments, so the deadlines travel as class attributes."""
    if header_timeout <= 0 or body_timeout <= 0:
        raise ValueError(f"header and body timeouts must be > 0 seconds, got {header_timeout} and {body_timeout}")
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


# -- concurrency limit ---------------------------------------------------------
class ConcurrencyLimit:
    """Beyond `limit` API requests (/v1/...) in flight, answer 503 before any work.

    uvicorn's own --limit-concurrency also counts open connections, idle kept-alive ones
    included, and answers in plain text; this counts the requests that cost something,
    and leaves /health, /metrics and the visualizer reachable under load."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {limit}")
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            return await send_error(send, 503, f"the server is at its limit of {self.limit} concurrent "
                                               "requests; retry later", "service_unavailable")
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


# -- graceful shutdown ---------------------------------------------------------
class ServerClosing(Exception):
    """The shutdown grace is over: the stream ends now."""


class GracefulShutdown:
    """Ends, `grace` seconds after the shutdown signal, what is still running.

    At the cut `closing` is set: streams see it (`until_closing`) and end with an
    error event and `data: [DONE]`, aborting their engine requests; requests that have
    not started a response are cancelled and answered 503. Requests that arrive after
    the cut get 503 too. uvicorn does the rest: it stops listening at the signal, closes
    idle connections and waits for the busy ones (give its own timeout a few seconds
    more than `grace`, as a backstop)."""

    def __init__(self, app: ASGIApp, closing: asyncio.Event, grace: float) -> None:
        if grace < 0:
            raise ValueError(f"graceful_shutdown_timeout must be >= 0 seconds, got {grace}")
        self.app, self.closing, self.grace = app, closing, grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._inflight: dict[asyncio.Task, bool] = {}  # request task -> has it started its response

    def begin(self) -> None:
        """Start the clock; safe to call from a signal handler. A second call cuts now."""
        if self._loop is not None:  # None: not serving yet, so nothing is in flight
            self._loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self.cut()
        else:
            logger.info("shutting down: %d request(s) in flight get %g s to finish", len(self._inflight), self.grace)
            self._timer = self._loop.call_later(self.grace, self.cut)  # type: ignore[union-attr]

    def cut(self) -> None:
        if self.closing.is_set():
            return
        if self._inflight:
            logger.warning("shutdown grace of %g s is over: ending %d request(s) still in flight",
                           self.grace, len(self._inflight))
        self.closing.set()
        for task, started in self._inflight.items():
            if not started:
                task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            self._loop = asyncio.get_running_loop()  # the loop begin() schedules on
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.closing.is_set():
            return await send_error(send, 503, CLOSING_MESSAGE, "service_unavailable", close=True)

        async def send_(message: dict) -> None:
            if message["type"] == "http.response.start":
                self._inflight[task] = True
            await send(message)

        # The request runs in its own task so that the cut can cancel it without
        # cancelling uvicorn's (which would then tear the connection).
        task = asyncio.ensure_future(self.app(scope, receive, send_))
        self._inflight[task] = False
        try:
            await task
        except asyncio.CancelledError:
            # Cut (or uvicorn's backstop) before any response: answer instead of tearing.
            if not self.closing.is_set() or self._inflight[task]:
                raise
            await send_error(send, 503, CLOSING_MESSAGE, "service_unavailable", close=True)
        finally:
            del self._inflight[task]


def until_closing(items: AsyncGenerator[T, None], closing: asyncio.Event) -> AsyncGenerator[T, None]:
    """`items` until `closing` is set; then ServerClosing, and `items` closed (a merged
    engine stream aborts its requests, freeing their blocks)."""
    return until(items, closing.wait(), lambda: ServerClosing(CLOSING_MESSAGE))


async def until(items: AsyncGenerator[T, None], stop: Awaitable[Any],
                error: Callable[[], Exception]) -> AsyncGenerator[T, None]:
    """`items` until `stop` completes; then raise error(), `items` closed. However this
    ends (its consumer cancelled or closed, too), a pending step of `items` is cancelled
    and awaited before `items.aclose()`: closing a generator that is still running in
    another task raises RuntimeError and leaves it, and what it holds, open."""
    stopped = asyncio.ensure_future(stop)
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(items.__anext__())
            await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                raise error()
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopped.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()  # raised inside items, where its own cleanup runs
            await asyncio.gather(nxt, return_exceptions=True)
        await items.aclose()
