"""Schema fuzzing: schemathesis generates bodies from the server's own /openapi.json,
valid and invalid, and no response may be a 5xx; the server serves afterwards."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from .conftest import MODEL


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


# /viz is left out: its event stream never ends, and its controls would pause the engine
# that the other tests of this session share.
schema = schemathesis.pytest.from_fixture("api_schema").include(path_regex="^/(v1|health|version|tokenize|detokenize)")


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    body = case.body
    if isinstance(body, dict):
        # Keep generation short: the point is parsing and validation, not decoding.
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(k), int) and body[k] > 2:
                body[k] = 2
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 2  # chat's default is the rest of the context
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 2:
            body["prompt"] = body["prompt"][:2]
    case.call_and_validate(checks=[not_a_server_error], timeout=120)


def test_still_serves_after_fuzzing(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
