"""Generated bodies at the app in process: for each endpoint that takes one, schemathesis draws
bodies from its schema in /openapi.json (the Anthropic and Responses shapes with their content
blocks and items, the adapter endpoints, embeddings, score, rerank, tokenize), valid and not, and
none may get a 5xx; the server is healthy afterwards. In process on the tiny model (the subject is
parsing and validation), with adapters enabled and runtime updates on behind an admin key, which
the requests carry: the adapter endpoints' bodies reach their checks. Bounded: a count of bodies
per endpoint, two tokens of generation each.

Then type confusion, which generated bodies rarely reach deep inside a union: valid bodies drawn
from each schema, each sent again with every one of its values in turn (a field, a block, an item,
at any depth) replaced by null, a number and a list: a wrong type anywhere is a 4xx, never a 500."""
from __future__ import annotations

import os
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from .inproc import serve_in_process
from .test_fuzz import _shorten

BODIES = 16    # generated per endpoint: 8 endpoints, 128 bodies (each run draws new ones)
VALID = 2      # valid bodies per endpoint whose every value is then replaced in turn (hundreds in all)
WRONG = (None, 7, [])
ENDPOINTS = {"POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses", "POST /v1/load_lora_adapter",
             "POST /v1/unload_lora_adapter", "POST /v1/embeddings", "POST /score", "POST /rerank"}
ADMIN = {"Authorization": "Bearer root"}


# Free-form objects by their APIs' own definitions (a JSON schema, a tool call's arguments,
# metadata): what is inside them has no type to get wrong, only the object itself.
FREE_FORM = {"input_schema", "parameters", "schema", "json_schema", "input", "metadata", "logit_bias"}


def _paths(body, at: tuple = ()) -> list[tuple]:
    """Every value's path in a JSON body (keys and indices), the body's own first; not inside
    free-form objects."""
    out = [at] if at else []
    if at and at[-1] in FREE_FORM and isinstance(body, dict):
        return out
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for k, v in items:
        out += _paths(v, (*at, k))
    return out


def _replaced(body, path: tuple, value):
    """A copy of body with the value at path replaced."""
    if not path:
        return value
    copy = dict(body) if isinstance(body, dict) else list(body)
    copy[path[0]] = _replaced(body[path[0]], path[1:], value)
    return copy


@pytest.fixture(scope="module")
def fuzz_server(tiny_flags):
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    s = serve_in_process(*tiny_flags, "--enable-lora", "--max-lora-rank", "8", "--admin-key", "root")
    yield s
    s.close()
    os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)


def test_generated_bodies_get_no_server_error(fuzz_server):
    client = fuzz_server.client(headers=ADMIN, timeout=120)
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    operations = {op.label: op for op in (r.ok() for r in schema.get_all_operations()) if op.label in ENDPOINTS}
    assert set(operations) == ENDPOINTS, ENDPOINTS - set(operations)
    sent, t0 = 0, time.monotonic()
    for label, op in sorted(operations.items()):
        cases = st.one_of(op.as_strategy(generation_mode=GenerationMode.POSITIVE),
                          op.as_strategy(generation_mode=GenerationMode.NEGATIVE))

        @given(case=cases)
        @settings(max_examples=BODIES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case):
            nonlocal sent
            _shorten(case.body)
            kw = {"content": case.body} if isinstance(case.body, (bytes, str)) else {"json": case.body}
            r = client.request(case.method, case.formatted_path, params=case.query, **kw)
            sent += 1
            assert r.status_code < 500, f"{label}: {r.status_code} {r.text[:300]} for {str(case.body)[:300]}"

        @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
        @settings(max_examples=VALID, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def confused_no_5xx(case):
            nonlocal sent
            _shorten(case.body)
            for path in _paths(case.body):
                for wrong in WRONG:
                    body = _replaced(case.body, path, wrong)
                    r = client.request(case.method, case.formatted_path, json=body)
                    sent += 1
                    assert r.status_code < 500, f"{label}: {r.status_code} {r.text[:300]} at {path} = {wrong!r}"

        no_5xx()
        confused_no_5xx()
    assert sent >= 400, sent
    print(f"{sent} bodies in {time.monotonic() - t0:.0f} s")
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert fuzz_server.engine.stats.num_running == 0
