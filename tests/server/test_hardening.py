"""Issue 12's probes, each against a real server: tenants in the visualizer, requests
that used to crash a shared step, malformed bodies, work on the event loop, and long
prompts ahead of short ones (the one probe of timing on the real model, the rest on the tiny one)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from hw import FAST_DTYPE
from tiny import TINY_NAME

from .conftest import MODEL, metrics, start_server, stop_server

ALICE, BOB, ADMIN = "alice-key", "bob-key", "root-key"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, tiny_flags):
    """The tiny model's server: the probes are of the HTTP layer, the step and the visualizer."""
    s = start_server(tmp_path_factory, *tiny_flags, "--api-key", ALICE, "--api-key", BOB, "--admin-key", ADMIN,
                     "--dtype", FAST_DTYPE, name="tenants")
    yield s
    stop_server(s)


class Watcher:
    """Reads /viz/events in a thread, as a tenant's browser would."""

    def __init__(self, url: str, key: str) -> None:
        self.messages: list[dict] = []
        self.raw: list[str] = []
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, key), daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "no snapshot"

    def _run(self, url: str, key: str) -> None:
        try:
            with httpx.stream("GET", f"{url}/viz/events?api_key={key}", timeout=60) as r:
                self.sock = r.extensions["network_stream"].get_extra_info("socket")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.raw.append(line)
                        self.messages.append(json.loads(line[6:]))
                        self.ready.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            if not self.stop.is_set():  # the stream failed on its own, not by close()
                raise

    def wait_for(self, condition, timeout: float = 30) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(condition(m) for m in list(self.messages)):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Hangs up at once: an idle stream would otherwise end only at the next keep-alive (15 s)."""
        self.stop.set()
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader blocked in recv()
        self.thread.join(30)
        assert not self.thread.is_alive()


def texts(msg: dict) -> list[str]:
    """Every token text a visualizer message carries."""
    out = list(msg.get("prompt", []))
    for pieces in msg.get("tokens", {}).values() if msg.get("kind") == "step" else []:
        out += pieces
    for s in msg.get("seqs", {}).values() if msg.get("kind") == "snapshot" else []:
        out += s["tokens"]
    return out


def complete(url: str, key: str, prompt: str, **kw) -> httpx.Response:
    body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, headers=auth(key), timeout=120)


def test_viz_shows_a_tenant_only_its_own_text(tenants):
    url = tenants.url
    bob, alice, admin = Watcher(url, BOB), Watcher(url, ALICE), Watcher(url, ADMIN)
    secret = "Zanzibar quartermaster ledger 4471: the vault code is hidden here"
    r = complete(url, ALICE, secret, max_tokens=6)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    for w in (bob, alice, admin):  # the step that finished the request reaches every watcher
        assert w.wait_for(lambda m: m["kind"] == "step" and m.get("finished")), "no finishing step"
        w.close()
    own = "".join(t for m in alice.messages for t in texts(m))
    assert "Zanzibar" in own, "a tenant sees its own prompt"
    assert "Zanzibar" in "".join(t for m in admin.messages for t in texts(m)), "the admin key sees everything"
    requests = [m for m in bob.messages if m["kind"] == "request"]
    assert requests and requests[0]["hidden"], "bob sees that a request arrived (blocks are shared) ..."
    assert all(t == "" for m in bob.messages for t in texts(m)), "... but none of its text"
    assert not any(rid in line for line in bob.raw), "nor its request id"
    assert any(m["kind"] == "step" and m["kv"] for m in bob.messages), "block ownership stays visible"


def test_viz_controls_need_the_admin_key(tenants):
    url = tenants.url
    for action in ({"action": "pause"}, {"action": "delay", "seconds": 10}):
        r = httpx.post(url + "/viz/control", json=action, headers=auth(BOB), timeout=10)
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    r = httpx.post(url + "/viz/scenarios/chat/run", headers=auth(BOB), timeout=10)
    assert r.status_code == 403
    t0 = time.time()
    assert complete(url, ALICE, "Count to four:", max_tokens=4).status_code == 200
    assert time.time() - t0 < 10, "alice is not slowed by bob's attempts"
    r = httpx.post(url + "/viz/control", json={"action": "delay", "seconds": 0}, headers=auth(ADMIN), timeout=10)
    assert r.status_code == 200 and r.json()["step_delay"] == 0


@pytest.mark.parametrize("params", [{"top_p": 1e-50}, {"top_p": 5e-324}, {"temperature": 1e-40},
                                    {"temperature": 1e-40, "top_p": 1e-50, "top_k": 2**70}])
def test_extreme_sampling_params_fail_nobody(tenants, params):
    """Each used to kill the shared step, and with it every other tenant's request."""
    url = tenants.url
    results: dict[str, httpx.Response] = {}

    def run(name: str, key: str, **kw) -> None:
        results[name] = complete(url, key, "Write a list of fruits:", **{
            "max_tokens": 24, "ignore_eos": True, "temperature": 0.8, "seed": 1, **kw})
    others = [threading.Thread(target=run, args=(f"other{i}", BOB)) for i in range(2)]
    for t in others:
        t.start()
    time.sleep(0.3)
    run("odd", ALICE, **params)
    for t in others:
        t.join()
    assert results["odd"].status_code == 200, results["odd"].text
    for i in range(2):
        r = results[f"other{i}"]
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert results["odd"].json()["usage"]["completion_tokens"] == 24


RAW_BAD = [
    ("deep-array", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("deep-prompt", b'{"model": "%s", "prompt": ' % TINY_NAME.encode() + b"[" * 10_000 + b"]" * 10_000 + b"}",
     "nested too deeply"),
    ("nan", b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % TINY_NAME.encode(), "NaN"),
    ("infinity", b'{"model": "%s", "prompt": "hi", "top_p": -Infinity}' % TINY_NAME.encode(), "Infinity"),
    ("overflow", b'{"model": "%s", "prompt": "hi", "temperature": 1e999}' % TINY_NAME.encode(), "float range"),
    ("huge-int", b'{"model": "%s", "prompt": "hi", "seed": 1%s}' % (TINY_NAME.encode(), b"0" * 5000), "valid JSON"),
    ("surrogate-prompt", b'{"model": "%s", "prompt": "a\\ud800b"}' % TINY_NAME.encode(), "surrogate"),
    ("surrogate-model", b'{"model": "\\udfff", "prompt": "a"}', "surrogate"),
    ("surrogate-key", b'{"model": "%s", "prompt": "a", "\\ud83d": 1}' % TINY_NAME.encode(), "surrogate"),
]


def test_malformed_bodies_get_400_and_keep_the_connection(tenants):
    with tenants.client(headers={**auth(ALICE), "Content-Type": "application/json"},
                      timeout=30) as c:
        for name, body, words in RAW_BAD:
            r = c.post("/v1/completions", content=body)
            assert r.status_code == 400, (name, r.status_code, r.text[:200])
            assert words in r.json()["error"]["message"], (name, r.json())
        chat = {"model": TINY_NAME, "messages": [{"role": "user", "content": "x\ud800"}]}
        r = c.post("/v1/chat/completions", content=json.dumps(chat).encode())
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
        parts = {"model": TINY_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}
        assert c.post("/v1/chat/completions", json=parts).status_code == 400
        # the same keep-alive connection still serves
        assert c.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_health_stays_fast_while_huge_prompts_arrive(tenants):
    url = tenants.url
    huge = "lorem ipsum dolor sit amet " * 150_000                           # ~4 MB: over any max_model_len
    large = "lorem ipsum dolor sit amet " * 5_000                            # tokenized, then too long
    done = []

    def send(prompt: str) -> None:
        done.append(complete(url, ALICE, prompt).status_code)
    senders = [threading.Thread(target=send, args=(p,)) for p in (huge, huge, large, huge, large)]
    lat = []
    with httpx.Client(timeout=10) as c:
        c.get(url + "/health")
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            t0 = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
    assert done == [400] * 5
    lat.sort()
    # Tokenizing one huge prompt takes ~4.5 s here: on the event loop it would hold /health that
    # long. The worst reading is allowed 1 s, since the suite's other worker and its servers share
    # the two cores (0.43 s seen once under that load); the median shows the loop is free.
    assert lat[len(lat) // 2] < 0.05 and lat[-1] < 1.0, f"/health latency while tokenizing: {lat[-5:]}"


@pytest.fixture(scope="module")
def long_ctx(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-model-len", "2048", "--max-num-batched-tokens", BUDGET,
                     "--dtype", FAST_DTYPE, name="long")
    yield s
    stop_server(s)


BUDGET = "512"   # tokens a step: a long prompt is prefilled 128 at a time (a quarter), ~9 steps for long_prompt()


def long_prompt(n_words: int = 400) -> str:  # ~1,170 tokens
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "engine"]
    return " ".join(words[i % 8] + str(i % 97) for i in range(n_words))


def test_short_request_is_not_stuck_behind_a_long_prefill(long_ctx):
    url = long_ctx.url
    first: dict[str, float] = {}

    def stream(name: str, prompt: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                assert r.status_code == 200, r.read()
                if line.startswith("data: {") and name not in first:
                    first[name] = time.time()
    t0 = time.time()
    long = threading.Thread(target=stream, args=("long", long_prompt(), 2))
    long.start()
    time.sleep(1.0)
    t_short = time.time()
    stream("short", "Hi", 2)
    long.join()
    assert first["short"] < first["long"], "the short request got its first token first"
    assert first["short"] - t_short < (first["long"] - t0) / 2


def test_abort_mid_prefill_frees_blocks_within_a_chunk(long_ctx):
    url = long_ctx.url
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 4, "stream": True}
    before = metrics(long_ctx)["pagedllm:computed_prompt_tokens_total"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300):
        deadline = time.time() + 60
        while metrics(long_ctx)["pagedllm:computed_prompt_tokens_total"] == before:
            assert time.time() < deadline
            time.sleep(0.05)
        at_close = metrics(long_ctx)["pagedllm:computed_prompt_tokens_total"]
    deadline = time.time() + 60
    while (m := metrics(long_ctx))["pagedllm:num_requests_running"] or m["pagedllm:kv_cache_usage_perc"]:
        assert time.time() < deadline, "the aborted request still holds blocks"
        time.sleep(0.05)
    chunk = int(BUDGET) // 4  # the automatic long-prefill threshold: a quarter of the step budget
    assert m["pagedllm:computed_prompt_tokens_total"] - at_close <= 2 * chunk
    assert m["pagedllm:computed_prompt_tokens_total"] - before < 1100, "the prefill did not run to its end"
