"""Pooling on the generating server: /v1/embeddings (the official openai client, float and
base64), /score and /rerank, each vector held to HF transformers' last hidden state of the
same weights; a repeated document prefix is served from the prefix cache, and generations
run beside embeddings on the one server."""
from __future__ import annotations

import math

import pytest
import torch

from .conftest import MODEL, metrics

# Two documents behind one long shared preamble: the second reuses the first's prefix blocks.
PREAMBLE = ("The city library's reference desk answers questions about opening hours, loans, renewals, "
            "fines, study rooms and the local history archive. ") * 3
DOCS = [PREAMBLE + "The library opens at nine and closes at six on weekdays.",
        PREAMBLE + "Books are lent for three weeks and renewed twice online.",
        "Paged attention stores the KV cache in fixed blocks."]


@pytest.fixture(scope="module")
def server(fp32_server):
    """Every vector here is held to HF transformers' float32."""
    return fp32_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai(api_key="unused", max_retries=0, timeout=120)


def _hf(hf_model, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    with torch.inference_mode():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return h / h.norm()


def test_embeddings_equal_hf_last_token_pooling(client, hf_model, server):
    tok = server.engine.info.tokenizer
    floats = client.embeddings.create(model=MODEL, input=DOCS, encoding_format="float")
    packed = client.embeddings.create(model=MODEL, input=DOCS)   # the client asks for base64 and decodes it
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.usage.prompt_tokens > 0
    for d, p, text in zip(floats.data, packed.data, DOCS):
        ours = torch.tensor(d.embedding)
        assert len(d.embedding) == hf_model.config.hidden_size and math.isclose(ours.norm().item(), 1, rel_tol=1e-5)
        assert torch.allclose(ours, _hf(hf_model, tok, text), atol=2e-4), (ours - _hf(hf_model, tok, text)).abs().max()
        assert torch.allclose(ours, torch.tensor(p.embedding), atol=1e-6)


def test_a_repeated_prefix_is_read_from_the_cache(server):
    hits = "pagedllm:prefix_cache_hits_total"
    before = metrics(server).get(hits, 0.0)
    r = server.client().post("/v1/embeddings", json={"model": MODEL, "input": [DOCS[0]]}, timeout=60).json()
    again = server.client().post("/v1/embeddings", json={"model": MODEL, "input": [DOCS[1]]}, timeout=60).json()
    assert metrics(server)[hits] - before >= 32, "the shared preamble's blocks were computed again"
    assert r["data"][0]["embedding"] != again["data"][0]["embedding"]


def test_score_and_rerank_are_cosines_of_the_embeddings(server, client):
    vecs = [torch.tensor(d.embedding) for d in client.embeddings.create(model=MODEL, input=DOCS,
                                                                       encoding_format="float").data]
    http = server.client()
    s = http.post("/score", json={"model": MODEL, "text_1": DOCS[0], "text_2": DOCS[1:]}, timeout=60).json()
    assert [d["index"] for d in s["data"]] == [0, 1]
    for d, v in zip(s["data"], vecs[1:]):
        assert math.isclose(d["score"], torch.dot(vecs[0], v).item(), abs_tol=1e-4)
    r = http.post("/v1/rerank", json={"model": MODEL, "query": DOCS[0], "documents": DOCS[1:], "top_n": 1},
                  timeout=60).json()
    best = max((1, 2), key=lambda i: torch.dot(vecs[0], vecs[i]).item())
    assert [x["index"] for x in r["results"]] == [best - 1] and r["results"][0]["document"]["text"] == DOCS[best]


def test_generations_and_embeddings_on_one_server(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.content
    assert len(client.embeddings.create(model=MODEL, input="Hi").data[0].embedding) > 0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 64}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [[10**9]]}, "input"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
])
def test_bad_pooling_requests_name_the_field(server, path, body, param):
    r = server.client().post(path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


LONG = "word " * 1500   # past the server's max_model_len


@pytest.mark.parametrize("body, says, param", [
    ({"query": LONG, "documents": ["a", "b"]}, "query:", "query"),
    ({"query": "q", "documents": ["a", LONG]}, "documents 1:", "documents"),
])
def test_a_bad_rerank_text_is_named_as_itself(server, body, says, param):
    r = server.client().post("/rerank", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(says), r.text
    assert r.json()["error"]["param"] == param
