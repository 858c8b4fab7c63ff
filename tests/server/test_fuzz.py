"""Schema fuzzing: schemathesis generates bodies from the socket_server's own /openapi.json,
valid and invalid, and no response may be a 5xx; the socket_server serves afterwards.

The cases come from schemathesis's public Hypothesis strategies (`APIOperation.as_strategy`)
under a plain `@given`, not from its pytest plugin: the plugin's lazy `from_fixture` path
writes pytest's private `Node._nodeid`, which pytest 9.2 removed."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from .conftest import MODEL

# /viz is left out: its event stream never ends, and its controls would pause the engine
# that the other tests of this session share.
FUZZED_PATHS = "^/(v1|health|version|tokenize|detokenize)"
MAX_TEXT = 256   # characters (or token ids) of a prompt or message kept


def _shorten(body: object) -> None:
    """Keep generation short: the point is parsing and validation, not decoding."""
    if not isinstance(body, dict):
        return
    for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(k), int) and body[k] > 2:
            body[k] = 2
    if all(body.get(k) is None for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        body["max_tokens"] = 2  # chat's default is the rest of the context
        body["max_output_tokens"] = 2  # as the Responses API's
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    # Nor prefill: a generated prompt of thousands of characters costs seconds of compute and
    # says nothing more about parsing (it made this test's time swing from 12 s to 55 s); nor
    # hundreds of inputs (an embeddings request takes up to 256).
    for k in ("prompt", "input"):
        v = body.get(k)
        if isinstance(v, str):
            body[k] = v[:MAX_TEXT]
        elif isinstance(v, list):
            body[k] = [p[:MAX_TEXT] if isinstance(p, (str, list)) else p for p in v[:2]]
    for k in ("system", "instructions"):
        if isinstance(body.get(k), str):
            body[k] = body[k][:MAX_TEXT]
    for m in body.get("messages") or [] if isinstance(body.get("messages"), list) else []:
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            m["content"] = m["content"][:MAX_TEXT]


def test_no_server_errors(socket_server):
    schema = schemathesis.openapi.from_url(socket_server.url + "/openapi.json").include(path_regex=FUZZED_PATHS)
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} <= labels, labels
    for op in operations:
        cases = st.one_of(op.as_strategy(generation_mode=GenerationMode.POSITIVE),
                          op.as_strategy(generation_mode=GenerationMode.NEGATIVE))

        @given(case=cases)
        @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case):
            _shorten(case.body)
            case.call_and_validate(checks=[not_a_server_error], timeout=120)

        try:
            no_5xx()
        except Exception as e:
            raise AssertionError(f"{op.label}: {e}") from e


def test_still_serves_after_fuzzing(socket_server):
    r = socket_server.client().post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
