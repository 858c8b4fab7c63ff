"""The HTTP guards in-process, no model: `until`, the SSE cut, the shutdown middleware."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.server.http import (
    ConcurrencyLimit,
    GracefulShutdown,
    ServerClosing,
    until_closing,
)
from pagedllm.server.streaming import ResponseBuilder


def endless(log: list[str]):
    """A stream that never ends on its own; its cleanup (what aborts engine requests) is logged."""
    async def gen():
        try:
            n = 0
            while True:
                await asyncio.sleep(0.01)
                n += 1
                yield n
        finally:
            log.append("closed")
    return gen()


def test_until_closing_ends_the_stream_and_closes_its_source():
    async def run():
        log: list[str] = []
        closing = asyncio.Event()
        got = []
        with pytest.raises(ServerClosing):
            async for n in until_closing(endless(log), closing):
                got.append(n)
                if n == 3:
                    asyncio.get_running_loop().call_later(0.005, closing.set)  # lands mid-step
        return got, log
    got, log = asyncio.run(run())
    assert got[:3] == [1, 2, 3] and len(got) <= 4
    assert log == ["closed"], "the source's cleanup ran before ServerClosing reached the consumer"


def test_until_closing_consumer_cancelled_mid_step_closes_its_source():
    # A client gone while the source is between items: the step running in another task
    # must be cancelled first, or aclose() raises "already running" and the source stays open.
    async def run():
        log: list[str] = []

        async def consume():
            async for _ in until_closing(endless(log), asyncio.Event()):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.055)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return log
    assert asyncio.run(run()) == ["closed"]


def fake_state():
    return SimpleNamespace(closing=asyncio.Event(), model_name="m", tokenizer=None,
                           metrics=SimpleNamespace(observe=lambda out: None))


def test_sse_ends_with_a_503_event_and_done_when_closing():
    async def run():
        log: list[str] = []
        state = fake_state()
        req = SimpleNamespace(stop=None, stream_options=None, prompt_only=False, logprobs=None, prompt_logprobs=None)
        resp = ResponseBuilder(state, req, "cmpl-1", chat=False, n=1)

        async def merged():
            try:  # the engine's DELTA outputs: each holds its new text and token
                for i in range(1000):
                    yield 0, RequestOutput("cmpl-1-0", "p", [1, 2], [CompletionOutput(0, f" w{i}", [i])],
                                           finished=False)
                    if i == 2:
                        state.closing.set()
                    await asyncio.sleep(0.01)
            finally:
                log.append("aborted")
        events = [e async for e in resp.sse(merged())]
        return events, log
    events, log = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable" and "shutting down" in err["message"]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]]
    assert "".join(texts).startswith(" w0 w1 w2") and len(texts) <= 4
    assert log == ["aborted"]


class Sent(list):
    async def __call__(self, message: dict) -> None:
        self.append(message)

    def status(self) -> int:
        return next(m["status"] for m in self if m["type"] == "http.response.start")

    def body(self) -> dict:
        return json.loads(b"".join(m.get("body", b"") for m in self if m["type"] == "http.response.body"))


def http_scope(path: str = "/v1/completions") -> dict:
    return {"type": "http", "path": path, "method": "POST", "headers": []}


async def no_body() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def test_shutdown_cut_answers_503_to_requests_without_a_response_and_spares_streams():
    async def run():
        cancelled: list[str] = []

        async def app(scope, receive, send):
            if scope["type"] == "lifespan":
                return
            try:
                if scope["path"] == "/stream":
                    await send({"type": "http.response.start", "status": 200, "headers": []})
                    await asyncio.sleep(0.3)  # the stream ends itself on `closing`, not by cancellation
                    await send({"type": "http.response.body", "body": b"end", "more_body": False})
                else:
                    await asyncio.sleep(30)  # a long non-streaming generation
            except asyncio.CancelledError:
                cancelled.append(scope["path"])
                raise

        closing = asyncio.Event()
        guard = GracefulShutdown(app, closing, grace=0.1)
        await guard({"type": "lifespan"}, no_body, Sent())
        slow, stream, late = Sent(), Sent(), Sent()
        t0 = asyncio.get_running_loop().time()
        tasks = [asyncio.ensure_future(guard(http_scope(p), no_body, s)) for p, s in [("/slow", slow),
                                                                                     ("/stream", stream)]]
        await asyncio.sleep(0.02)
        guard.begin()
        await tasks[0]
        cut_after = asyncio.get_running_loop().time() - t0
        await guard(http_scope(), no_body, late)  # arrives after the cut
        await tasks[1]
        return cancelled, slow, stream, late, cut_after, closing.is_set()
    cancelled, slow, stream, late, cut_after, closing = asyncio.run(run())
    assert closing and 0.1 <= cut_after < 1.0
    assert cancelled == ["/slow"]
    for s in (slow, late):
        assert s.status() == 503 and s.body()["error"]["code"] == 503
        assert (b"connection", b"close") in s[0]["headers"]
    assert stream.status() == 200 and stream[-1]["body"] == b"end"


def test_second_signal_cuts_at_once():
    async def run():
        async def app(scope, receive, send):
            if scope["type"] == "http":
                await asyncio.sleep(30)
        closing = asyncio.Event()
        guard = GracefulShutdown(app, closing, grace=60)
        await guard({"type": "lifespan"}, no_body, Sent())
        sent = Sent()
        task = asyncio.ensure_future(guard(http_scope(), no_body, sent))
        await asyncio.sleep(0.01)
        guard.begin()
        await asyncio.sleep(0.05)
        assert not closing.is_set()
        guard.begin()
        await asyncio.wait_for(task, 2)
        return sent
    assert asyncio.run(run()).status() == 503


def test_concurrency_limit_counts_api_requests_only():
    async def run():
        release = asyncio.Event()

        async def app(scope, receive, send):
            if scope["path"].startswith("/v1/"):
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})
        limit = ConcurrencyLimit(app, 2)
        first = [Sent(), Sent()]
        tasks = [asyncio.ensure_future(limit(http_scope(), no_body, s)) for s in first]
        await asyncio.sleep(0.01)
        third, health = Sent(), Sent()
        await limit(http_scope(), no_body, third)
        await limit(http_scope("/health"), no_body, health)
        release.set()
        await asyncio.gather(*tasks)
        after = Sent()
        await limit(http_scope(), no_body, after)
        return first, third, health, after, limit.active
    first, third, health, after, active = asyncio.run(run())
    assert third.status() == 503 and third.body()["error"]["type"] == "service_unavailable"
    assert [s.status() for s in first] == [200, 200] and health.status() == 200 and after.status() == 200
    assert active == 0
