"""A vLLM user feels at home (issue 13): model naming, requests without `model`, special
tokens per endpoint, unsupported fields refused by name, echo, /tokenize and /detokenize."""
from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from .conftest import MODEL
from .inproc import serve_in_process

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Name a colour."}]


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return server.client().post(path, json=body, timeout=120, **kw)


@pytest.fixture(scope="module")
def client(server):
    return server.openai(api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(None))


# -- 1. naming ------------------------------------------------------------------------
def test_dotted_model_name_served_whole(tmp_path_factory):
    from pagedllm.loader import default_gguf_path

    link = tmp_path_factory.mktemp("models") / "Smol.LM2-v1.5-Instruct.gguf"
    os.symlink(default_gguf_path(), link)
    s = serve_in_process("--model", str(link), "--kv-cache-memory", "32MiB")
    try:
        models = s.client().get("/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["Smol.LM2-v1.5-Instruct"]
        for name in ("Smol.LM2-v1.5-Instruct", str(link)):  # the name, or --model as given
            r = post(s, COMP, {"model": name, "prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "Smol.LM2-v1.5-Instruct", r.text
        assert post(s, COMP, {"model": "Smol", "prompt": "Hi", "max_tokens": 1}).status_code == 404
    finally:
        s.close()


def test_request_without_model_means_the_served_one(server):
    for path, body in ((COMP, {"prompt": "Hi", "max_tokens": 1}), (CHAT, {"messages": MSGS, "max_tokens": 1})):
        r = post(server, path, body)
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    assert post(server, COMP, {"model": None, "prompt": "Hi", "max_tokens": 1}).status_code == 200
    r = post(server, COMP, {"model": "gpt-4o", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# -- 3. special tokens per endpoint ---------------------------------------------------
def test_completion_and_chat_prompt_tokens_match_the_tokenizer(server, tokenizer):
    text = "The library opens at nine"
    r = post(server, COMP, {"prompt": text, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(tokenizer.encode(text))  # with the tokenizer's own specials
    template = tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    r = post(server, CHAT, {"messages": MSGS, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(tokenizer.encode(template, add_special_tokens=False))
    t = post(server, "/tokenize", {"messages": MSGS}).json()
    assert t["count"] == r["usage"]["prompt_tokens"]


# -- 5. unsupported fields ------------------------------------------------------------
@pytest.mark.parametrize("path,field,value", [
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "echo", True),
    (CHAT, "chat_template", "{{ messages }}"),
    (CHAT, "logits_processors", ["pkg.Processor"]),
    (COMP, "suffix", " the end"),
    (COMP, "logits_processors", ["pkg.Processor"]),
])
def test_unsupported_field_is_refused_by_name(server, path, field, value):
    body = {"model": MODEL, "max_tokens": 1, field: value}
    body.update({"messages": MSGS} if path == CHAT else {"prompt": "Hi"})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_harmless_fields_pass(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, user="u-1", metadata={"k": "v"},
                                       store=False, tool_choice="none", response_format={"type": "text"},
                                       parallel_tool_calls=False)
    assert r.choices[0].finish_reason in ("length", "stop")
    # tools alone mean tool_choice "auto", which needs the server's tool-call parser (vLLM's rule)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser") as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert e.value.param == "tool_choice"


# -- 5. echo --------------------------------------------------------------------------
def test_echo_prepends_the_prompt(client, tokenizer):
    prompt = "1, 2, 3,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=[prompt, "a, b,"], max_tokens=4, temperature=0,
                                       echo=True, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == echoed.choices[0].text and texts[1].startswith("a, b,")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text


# -- 5. /tokenize and /detokenize -------------------------------------------------------
def test_tokenize_detokenize_round_trip(server, tokenizer):
    text = "Paged attention: blocks, tables, and a café ☕"
    t = post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert t["tokens"] == tokenizer.encode(text) and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == 1024 and t.get("token_strs") is None
    d = post(server, "/detokenize", {"model": MODEL, "tokens": t["tokens"]}).json()
    assert d == {"prompt": tokenizer.decode(t["tokens"])} and text in d["prompt"]
    strs = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello world"))
    chat = post(server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    template = tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=False)
    assert chat["tokens"] == tokenizer.encode(template, add_special_tokens=False)
    assert post(server, "/tokenize", {"prompt": ""}).json()["count"] == 0


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, 2, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
    ("/detokenize", {"tokens": [1.5]}, "tokens.0"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/detokenize", {"tokens": [1] * 1025}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "word " * 1500}, "prompt"),
    ("/tokenize", {"prompt": "x" * 200_000}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
])
def test_tokenize_bad_input(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.status_code == (404 if param == "model" else 400)
    assert r.json()["error"]["param"] == param, r.text


def test_tokenize_needs_the_key(keyed_server):
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        assert post(keyed_server, path, body).status_code == 401
        r = post(keyed_server, path, body, headers={"Authorization": "Bearer alice-key"})
        assert r.status_code == 200, r.text


def test_tokenize_routes_in_openapi(server):
    schema = server.client().get("/openapi.json", timeout=30).json()
    body = schema["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in body["anyOf"]} == {"TokenizeCompletionRequest",
                                                                        "TokenizeChatRequest"}
    assert "DetokenizeRequest" in json.dumps(schema["paths"]["/detokenize"])


# -- 6. beam search and best_of ----------------------------------------------------------
def test_beam_search_over_the_api(server, make_llm):
    """use_beam_search with n as the width: the engine's beams, best first, as LLM.beam_search gives them."""
    from hw import FAST_DTYPE

    from pagedllm import BeamSearchParams

    offline = make_llm(dtype=FAST_DTYPE, kv_cache_memory="160MiB", max_model_len=1024)

    prompt = "The capital of France is"
    r = post(server, COMP, {"model": MODEL, "prompt": prompt, "n": 3, "max_tokens": 8, "use_beam_search": True,
                            "length_penalty": 0.8, "early_stopping": True})
    assert r.status_code == 200, r.text
    want = offline.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.8,
                                                         early_stopping=True))[0].sequences
    assert [c["text"] for c in r.json()["choices"]] == [s.text for s in want]
    assert r.json()["usage"]["completion_tokens"] == sum(len(s.tokens) for s in want) - 3 * len(
        offline.tokenizer.encode(prompt))
    chat = post(server, CHAT, {"model": MODEL, "messages": MSGS, "n": 2, "max_tokens": 6, "use_beam_search": True})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2, chat.text
    # Streamed, the beams arrive when the search ends (a beam's tokens can still be dropped before).
    texts: dict[int, str] = {}
    with server.client().stream("POST", COMP, json={"model": MODEL, "prompt": prompt, "n": 3, "max_tokens": 8,
                                                       "use_beam_search": True, "length_penalty": 0.8,
                                                       "early_stopping": True, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [s.text for s in want]


def test_best_of_returns_the_n_best_samples(server):
    r = post(server, COMP, {"model": MODEL, "prompt": "Hi", "n": 2, "best_of": 4, "max_tokens": 5, "seed": 3,
                            "temperature": 0.9})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


@pytest.mark.parametrize("extra, name", [
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "n": 17}, "n"),
    ({"best_of": 3, "n": 1, "stream": True}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
])
def test_bad_beam_and_best_of_requests_are_refused(server, extra, name):
    r = post(server, COMP, {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert name in r.json()["error"]["message"], r.json()

