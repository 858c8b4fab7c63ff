"""Bad input gets an OpenAI-shaped 4xx error, and the server stays healthy after each."""
from __future__ import annotations

import pytest

from .conftest import MODEL

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

CASES = [
    ("malformed json", CHAT, b'{"model": "x", "messages": [', 400, None),
    ("not an object", CHAT, b"[1, 2, 3]", 400, None),
    ("invalid utf-8", CHAT, b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     400, None),
    ("wrong type max_tokens", CHAT, {**OK_CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong type temperature", CHAT, {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("messages not a list", CHAT, {**OK_CHAT, "messages": "hello"}, 400, "messages"),
    ("unknown model", CHAT, {**OK_CHAT, "model": "gpt-4o"}, 404, "model"),
    ("negative max_tokens", CHAT, {**OK_CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("huge max_tokens", CHAT, {**OK_CHAT, "max_tokens": 10**9}, 400, None),
    ("temperature out of range", COMP, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p out of range", COMP, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n = 0", COMP, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("empty messages", CHAT, {**OK_CHAT, "messages": []}, 400, "messages"),
    ("message without role", CHAT, {**OK_CHAT, "messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("invalid role", CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("content of wrong type", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 42}]}, 400, None),
    ("missing prompt", COMP, {"model": MODEL}, 400, "prompt"),
    ("empty prompt", COMP, {"model": MODEL, "prompt": ""}, 400, None),
    ("empty token list", COMP, {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("token id out of vocab", COMP, {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, None),
    ("prompt beyond max_model_len", COMP, {"model": MODEL, "prompt": "word " * 1500, "max_tokens": 1}, 400, None),
    ("penalty out of range", COMP, {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("repetition_penalty 0", COMP, {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_p above 1", COMP, {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("min_tokens above max_tokens", COMP, {"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, None),
    ("logit_bias beyond the vocabulary", COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"999999999": 5}}, 400, None),
]


@pytest.mark.parametrize("name, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, path, body, status, param):
    with server.client(timeout=60) as c:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = c.post(path, headers={"content-type": "application/json"}, **kw)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param, err
        assert c.get("/health").status_code == 200
        assert c.post(CHAT, json=OK_CHAT).status_code == 200, "the server must keep serving"


def test_oversized_body(server):
    with server.client(timeout=60) as c:
        r = c.post(COMP, json={"model": MODEL, "prompt": "x" * (5 * 1024 * 1024)})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert c.post(CHAT, json=OK_CHAT).status_code == 200
