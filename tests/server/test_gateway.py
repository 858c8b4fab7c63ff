"""Behind the SGLang Model Gateway (PyPI sglang-router): /model_info and /server_info say what
a gateway reads, truthfully and behind the keys; the real gateway in front of a real
`pagedllm serve` worker names our model and serves completions and chats, streamed and not.
(Two workers behind it are benchmarks/gateway_vs_dp.py's: a second server here would add
~10 s to the suite for nothing the gateway does differently per worker.)"""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from benchmarks.lib.gateway import Gateway

from .conftest import MODEL


def test_model_info_and_server_info_name_the_model_and_its_limits(server):
    info = server.client().get("/model_info", timeout=10).json()
    assert (info["model_type"], info["architectures"], info["is_generation"]) == ("llama", ["LlamaForCausalLM"], True)
    assert (Path(info["tokenizer_path"]) / "tokenizer.json").is_file()  # a gateway here can load it
    assert (Path(info["model_path"]) / "config.json").is_file()
    assert server.client().get("/get_model_info", timeout=10).json() == info  # SGLang's older path
    s = server.client().get("/server_info", timeout=10).json()
    models = server.client().get("/v1/models", timeout=10).json()["data"][0]
    assert s["served_model_name"] == models["id"] == MODEL
    assert s["context_length"] == models["max_model_len"] == 1024  # start_server's --max-model-len
    assert s["page_size"] == models["block_size"] == 16
    assert s["max_total_num_tokens"] == models["kv_cache_blocks"] * 16
    assert (s["tp_size"], s["dp_size"], s["disable_radix_cache"]) == (1, 1, False)
    assert s["model_path"] == info["model_path"] and s["tokenizer_path"] == info["tokenizer_path"]


def test_model_info_and_server_info_are_behind_the_keys_and_hold_none(keyed_server):
    for path in ("/model_info", "/server_info", "/get_server_info"):
        assert keyed_server.client().get(path, timeout=10).status_code == 401
        assert keyed_server.client().get(path, headers={"Authorization": "Bearer eve"}, timeout=10).status_code == 401
        r = keyed_server.client().get(path, headers={"Authorization": "Bearer bob-key"}, timeout=10)
        assert r.status_code == 200 and "key" not in r.text.lower()


@pytest.fixture(scope="module")
def gateway(socket_server):
    """sglang-router's gateway, cache_aware, in front of the session's server (on its socket)."""
    gw = Gateway([socket_server.url], "cache_aware")
    yield gw.url, socket_server.url
    gw.stop()


def test_the_gateway_names_our_model_and_serves_through_it(gateway):
    url, worker = gateway
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == [MODEL]
    listed = httpx.get(url + "/workers", timeout=10).json()["workers"]
    assert {w["model_id"] for w in listed} == {MODEL}  # not `unknown`
    assert {w["metadata"]["model_type"] for w in listed} == {"llama"}

    via = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=worker + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    want = direct.completions.create(prompt="The capital of France is", **kw).choices[0].text
    c = via.completions.create(prompt="The capital of France is", **kw)
    assert c.choices[0].text == want and c.usage.completion_tokens == 4
    chunks = list(via.completions.create(prompt="The capital of France is", stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want

    msgs = [{"role": "user", "content": "Say hello."}]
    want = direct.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    assert want and via.chat.completions.create(messages=msgs, **kw).choices[0].message.content == want
    chunks = list(via.chat.completions.create(messages=msgs, stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
