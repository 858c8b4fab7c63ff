"""Real servers: read deadlines, --limit-concurrency, and the graceful shutdown's cut."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from .conftest import MODEL, start_server, stop_server

HEADER_TIMEOUT, BODY_TIMEOUT, GRACE = 1.0, 1.5, 2.0
SLACK = 2.5  # a busy 2-core machine
OK = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    s = start_server(tmp_path_factory, "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                     "--limit-concurrency", "2", name="guarded")
    yield s
    stop_server(s)


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def post_head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def split_response(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_stalled_and_trickled_headers_are_cut(guarded):
    t0 = time.monotonic()
    silent = connect(guarded)  # never sends a byte
    stalled = [connect(guarded) for _ in range(20)]
    for s in stalled:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # half the headers, then nothing
    trickle = connect(guarded)
    done = threading.Event()

    def dribble() -> None:  # a byte every 0.2 s: the deadline is for the whole header, not per byte
        try:
            for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200:
                if done.is_set():
                    return
                trickle.sendall(bytes([b]))
                time.sleep(0.2)
        except OSError:
            pass
    threading.Thread(target=dribble, daemon=True).start()
    r = guarded.client().post("/v1/completions", content=OK, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, "others are served meanwhile"
    try:
        assert read_until_closed(silent) == b"", "nothing sent: closed without an answer"
        for s in stalled:
            status, body = split_response(read_until_closed(s))
            assert status == 408 and json.loads(body)["error"]["code"] == 408
        try:  # a byte it sends after the close resets the connection, losing the 408 in flight
            read_until_closed(trickle)
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < HEADER_TIMEOUT + SLACK
    finally:
        done.set()
        for s in stalled + [silent, trickle]:
            s.close()


def test_partial_body_gets_408_and_the_connection_closes(guarded):
    s = connect(guarded)
    t0 = time.monotonic()
    s.sendall(post_head(len(OK)) + OK[:10])
    raw = read_until_closed(s)  # returns once the server closes: no half-read request left open
    elapsed = time.monotonic() - t0
    s.close()
    status, body = split_response(raw)
    err = json.loads(body)["error"]
    assert status == 408 and err["code"] == 408 and err["type"] == "invalid_request_error"
    assert "body" in err["message"]
    assert BODY_TIMEOUT - 0.1 <= elapsed < BODY_TIMEOUT + SLACK


def test_slow_but_timely_clients_and_keep_alive_are_unaffected(guarded):
    s = connect(guarded)
    try:
        for i in range(2):
            s.sendall(post_head(len(OK)))
            for k in range(0, len(OK), 20):  # the body in pieces, within the deadline
                time.sleep(0.2)
                s.sendall(OK[k:k + 20])
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = b""
            while len(body) < length:
                body += s.recv(length - len(body))
            assert head.startswith(b"HTTP/1.1 200"), head
            assert json.loads(body)["usage"]["completion_tokens"] == 2
            if i == 0:  # idle between requests past the header timeout (keep-alive allows 5 s)
                time.sleep(HEADER_TIMEOUT + 0.8)
    finally:
        s.close()
    t0 = time.monotonic()
    data = []
    with guarded.client().stream("POST", "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "Count:", "max_tokens": 120, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    # An error event is a JSON object with an "error" key (a sampled token may itself read "error").
    # Tokens are counted from the usage chunk: a slow reader may get several steps' deltas in one
    # event (and bytes of a split character wait for the rest), so events are fewer than tokens.
    events = [json.loads(x[6:]) for x in data[:-1]]
    assert data[-1] == "data: [DONE]" and all("error" not in e for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 120 and len(events) > 20
    assert time.monotonic() - t0 > BODY_TIMEOUT, "a response longer than the read deadlines is left alone"


def test_limit_concurrency_answers_503_beyond_the_limit(guarded):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with guarded.client(timeout=120) as c:
        streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        try:
            lines = [r.iter_lines() for r in responses]
            for it in lines:  # both are in flight: each has sent its first token
                assert next(x for x in it if x.startswith("data: {"))
            t0 = time.monotonic()
            third = guarded.client().post("/v1/completions", json={**body, "stream": False}, timeout=60)
            assert time.monotonic() - t0 < 2.0, "refused at once, not queued"
            assert third.status_code == 503
            err = third.json()["error"]
            assert err["code"] == 503 and err["type"] == "service_unavailable" and "limit of 2" in err["message"]
            assert guarded.client().get("/health", timeout=10).status_code == 200, "probes stay reachable"
            assert guarded.client().get("/metrics", timeout=10).status_code == 200
            assert [[x for x in it if x.startswith("data: ")][-1] for it in lines] == ["data: [DONE]"] * 2
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    r = guarded.client().post("/v1/completions", content=OK, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, "the slots come back"


def test_shutdown_ends_running_streams_cleanly_and_exits_0(tmp_path_factory):
    srv = start_server(tmp_path_factory, "--shutdown-timeout", str(GRACE), name="grace")  # vLLM's name
    long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    events: list[tuple[float, str]] = []
    result: dict = {}

    def stream() -> None:
        try:
            with srv.client().stream("POST", "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():  # raises on a torn chunked body
                    if line:
                        events.append((time.monotonic(), line))
            result["stream"] = "complete"
        except httpx.HTTPError as e:
            result["stream"] = repr(e)

    def plain() -> None:
        try:
            result["plain"] = srv.client().post("/v1/completions", json=long, timeout=60)
        except httpx.HTTPError as e:
            result["plain"] = repr(e)

    threads = [threading.Thread(target=f) for f in (stream, plain)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(events) >= 3, srv.log()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            srv.client().get("/health", timeout=5)  # no new connections while draining
        for t in threads:
            t.join(30)
        assert srv.proc.wait(30) == 0
        exited = time.monotonic() - t0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert result["stream"] == "complete", (result, srv.log())
    lines = [line for _, line in events]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"] and err["type"] == "service_unavailable"
    assert sum(1 for ts, _ in events if ts > t0 + 0.5) > 2, "the stream kept going during the grace"
    cut = next(ts for ts, line in events if '"error"' in line) - t0
    assert GRACE - 0.1 <= cut < GRACE + SLACK
    plain_r = result["plain"]
    assert isinstance(plain_r, httpx.Response), (plain_r, srv.log())
    assert plain_r.status_code == 503 and plain_r.json()["error"]["code"] == 503, plain_r.text
    assert exited < GRACE + SLACK + 1, "exits promptly after the cut, not at uvicorn's backstop"
