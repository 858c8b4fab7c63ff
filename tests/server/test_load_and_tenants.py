"""Concurrency with disconnects, leak checks, tenant isolation, metrics, shutdown."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from tiny import TINY_NAME

from .conftest import MODEL, metric_sample, metrics, start_server, stop_server

LONG = ("Our return policy, in full: items may be returned within thirty days with a receipt; opened "
        "software, gift cards and perishable goods cannot be returned; refunds go to the original card "
        "within five business days; exchanges are free in store. ")


async def stream_chat(client: httpx.AsyncClient, i: int, disconnect_after: int | None,
                      max_tokens: int = 20) -> dict:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7,
            "seed": i, "messages": [{"role": "user", "content": f"Tell me fact number {i} about the ocean."}]}
    result = {"chunks": 0, "done": False, "finish": None, "disconnected": False}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            result["chunks"] += 1
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                result["finish"] = chunk["choices"][0]["finish_reason"]
            if disconnect_after is not None and result["chunks"] >= disconnect_after:
                result["disconnected"] = True
                break  # leaving the block closes the connection mid-stream
    return result


def wait_idle(server, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        if m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0 \
                and m["pagedllm:kv_cache_usage_perc"] == 0:
            return m
        if time.time() > deadline:
            raise AssertionError(f"server not idle: {m}")
        time.sleep(0.3)


SUCCESS = "pagedllm:request_success_total"
GEN = "pagedllm:generation_tokens_total"
SHORT, LONG_RUN = 20, 400  # tokens of a stream that completes; of one that is cut off after its first chunk


def test_64_concurrent_streams_with_disconnects(socket_server):
    """48 streams complete, 16 leave after their first chunk (sockets closed mid-stream). A leaver asks for 400
    tokens (ignore_eos), so it cannot finish before it leaves: exactly 48 successes and 16 aborts, and fewer than
    400 tokens each for those."""
    server = socket_server
    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=240, limits=limits) as c:
            tasks = [stream_chat(c, i, 1, LONG_RUN) if i % 4 == 0 else stream_chat(c, i, None, SHORT)
                     for i in range(64)]
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)

    before = metrics(server)
    length0 = metric_sample(server, SUCCESS, finished_reason="length")
    abort0 = metric_sample(server, SUCCESS, finished_reason="abort")
    results = asyncio.run(run())
    for i, r in enumerate(results):
        if i % 4 == 0:
            assert r["disconnected"] and not r["done"] and r["finish"] is None, (i, r)
        else:
            assert r["done"] and r["finish"] == "length", (i, r)
    m = wait_idle(server)
    assert m["pagedllm:kv_cache_free_blocks"] + m["pagedllm:kv_cache_cached_free_blocks"] == \
        m["pagedllm:kv_cache_total_blocks"], "every block is free or cached: no leak"
    assert metric_sample(server, SUCCESS, finished_reason="length") - length0 == 48
    assert metric_sample(server, SUCCESS, finished_reason="abort") - abort0 == 16
    assert m[SUCCESS] - before.get(SUCCESS, 0) == 64, "no other finish reason"
    generated = m[GEN] - before[GEN]
    assert 48 * SHORT + 16 <= generated < 48 * SHORT + 16 * LONG_RUN, \
        f"the 16 aborted streams generated at least one and fewer than {LONG_RUN} tokens each: {generated}"
    assert "running:" in server.log() and "KV usage" in server.log(), "periodic status line"


def test_non_streaming_disconnect_aborts(socket_server):
    server = socket_server
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True}
    before = metrics(server)
    abort0 = metric_sample(server, SUCCESS, finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        server.client().post("/v1/completions", json=body, timeout=1.5)
    m = wait_idle(server, timeout=20)  # aborted well before 400 tokens could finish
    assert m["pagedllm:kv_cache_free_blocks"] + m["pagedllm:kv_cache_cached_free_blocks"] == \
        m["pagedllm:kv_cache_total_blocks"]
    assert metric_sample(server, SUCCESS, finished_reason="abort") - abort0 == 1
    assert m[SUCCESS] - before.get(SUCCESS, 0) == 1, "counted once, as an abort"
    generated = m[GEN] - before[GEN]
    assert generated < body["max_tokens"], f"aborted before its {body['max_tokens']} tokens: {generated}"


def test_metrics_parse_and_move(server):
    before = metrics(server)
    r = server.client().post("/v1/completions", json={"model": MODEL, "prompt": LONG, "max_tokens": 5,
                                                         "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    after = metrics(server)
    assert after["pagedllm:prefix_cache_queries_total"] >= before["pagedllm:prefix_cache_queries_total"] + 40
    assert after["pagedllm:generation_tokens_total"] == before["pagedllm:generation_tokens_total"] + 5
    assert after["pagedllm:prompt_tokens_total"] > before["pagedllm:prompt_tokens_total"]
    assert after["pagedllm:e2e_request_latency_seconds_count"] == before["pagedllm:e2e_request_latency_seconds_count"] + 1
    assert after["pagedllm:time_to_first_token_seconds_count"] > before["pagedllm:time_to_first_token_seconds_count"]
    r2 = server.client().post("/v1/completions", json={"model": MODEL, "prompt": LONG, "max_tokens": 1},
                    timeout=60)
    hits = metrics(server)["pagedllm:prefix_cache_hits_total"] - after["pagedllm:prefix_cache_hits_total"]
    assert hits == r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metrics(server)["pagedllm:kv_cache_cached_free_blocks"] > 0, "idle but the cache is still warm"


def test_api_keys_and_tenant_isolation(keyed_server):
    client = keyed_server.client()
    body = {"model": TINY_NAME, "prompt": LONG + "Summarize it.", "max_tokens": 1}

    def post(key, **extra):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return client.post("/v1/completions", json={**body, **extra}, headers=headers, timeout=60)

    assert post(None).status_code == 401
    assert post("mallory-key").json()["error"]["type"] == "authentication_error"
    assert client.get("/v1/models").status_code == 401
    cached = lambda r: r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(post("alice-key")) == 0
    assert cached(post("bob-key")) == 0, "another tenant's blocks must never be hit"
    assert cached(post("bob-key", cache_salt="x")) == 0, "a client salt cannot reach another tenant"
    assert cached(post("alice-key")) > 0
    assert cached(post("bob-key")) > 0


def test_queue_limit_and_graceful_shutdown(tmp_path_factory, tiny_flags):
    srv = start_server(tmp_path_factory, *tiny_flags, "--max-queue-len", "2", "--max-num-seqs", "1", name="small")
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                body = {"model": TINY_NAME, "prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True}
                rs = await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(8)])
                return [r.status_code for r in rs], [r.json() for r in rs]
        codes, bodies = asyncio.run(run())
        assert 503 in codes and 200 in codes, codes
        assert all(b["error"]["code"] == 503 for c, b in zip(codes, bodies) if c == 503)

        async def in_flight():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                body = {"model": TINY_NAME, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
                        "stream": True}
                text = []
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                            if len(text) == 2:
                                srv.proc.send_signal(signal.SIGTERM)
                        if line == "data: [DONE]":
                            return len(text)
                return -1
        assert asyncio.run(in_flight()) >= 30, "the in-flight request finishes during graceful shutdown"
        assert srv.proc.wait(60) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


@pytest.fixture(scope="module")
def keyed_socket_server(tmp_path_factory, tiny_flags):
    """Keys, on a socket: an event stream (the visualizer's) never ends, so it is read off a real one.
    The tiny model's: only the keys are checked here."""
    s = start_server(tmp_path_factory, *tiny_flags, "--api-key", "alice-key", "--api-key", "bob-key", name="keyed")
    yield s
    stop_server(s)


def test_visualizer_needs_a_key_and_rejects_bad_controls(keyed_socket_server, server):
    url = keyed_socket_server.url
    assert httpx.get(url + "/viz/", timeout=10).status_code == 401, "the page shows every request's text"
    assert httpx.get(url + "/viz/state", timeout=10).status_code == 401
    assert httpx.get(url + "/viz/events", timeout=10).status_code == 401
    assert httpx.get(url + "/viz/?api_key=alice-key", timeout=10).status_code == 200
    # A key in the Authorization header opens the state read too, and what it reads is this
    # server's pool: its block count is the one /v1/models gives under the same key.
    bob = {"Authorization": "Bearer bob-key"}
    assert httpx.get(url + "/viz/state", headers={"Authorization": "Bearer eve-key"}, timeout=10).status_code == 401
    r = httpx.get(url + "/viz/state", headers=bob, timeout=30)
    assert r.status_code == 200, r.text
    viz = r.json()
    blocks = httpx.get(url + "/v1/models", headers=bob, timeout=10).json()["data"][0]["kv_cache_blocks"]
    assert type(viz["step"]) is int and viz["config"]["num_blocks"] == blocks > 0, (viz["step"], viz["config"], blocks)
    with httpx.stream("GET", url + "/viz/events?api_key=alice-key", timeout=30) as r:  # SSE starts with a snapshot
        line = next(x for x in r.iter_lines() if x.startswith("data: "))
        assert '"kind":"snapshot"' in line
    bad = [({"action": "explode"}, "action"), ({"action": "delay", "seconds": -1}, "seconds"),
           ({"action": "delay", "seconds": "slow"}, "seconds")]
    for body, param in bad:
        r = server.client().post("/viz/control", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = server.client().post("/viz/scenarios/nope/run", timeout=10)
    assert r.status_code == 404 and "chat" in r.json()["error"]["message"]
    assert {s["name"] for s in server.client().get("/viz/scenarios", timeout=10).json()} >= {
        "library", "chat", "parallel-n4", "beam", "preemption"}
