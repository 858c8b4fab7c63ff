"""--otlp-traces-endpoint: each request's llm_request span, with vLLM's gen_ai.* attributes and
its queue / prefill / decode children, reaches an OTLP/HTTP collector (one in this process,
decoding the SDK's protobuf), inside the caller's trace when the request carries a
traceparent; with no endpoint the server has no tracer at all."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedllm.util import free_port

from .inproc import serve_in_process

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace receiver: every span it is sent, by name."""

    def __init__(self) -> None:
        self.spans: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        collector.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def traced(tiny_flags):
    collector = Collector()
    s = serve_in_process(*tiny_flags, "--otlp-traces-endpoint", collector.url)
    yield s, collector
    s.close()
    collector.http.shutdown()


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.string_value or v.int_value or v.double_value
    return out


def test_a_request_is_a_span_in_the_callers_trace(traced):
    server, collector = traced
    name = server.built.state.model_name
    r = server.client().post("/v1/chat/completions", timeout=60,
                             headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"},
                             json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                   "temperature": 0, "ignore_eos": True}).json()
    server.built.state.tracer.provider.force_flush()
    (span,) = [s for s in collector.spans if s.name == "llm_request"]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT
    a = _attrs(span)
    assert a["gen_ai.usage.prompt_tokens"] == r["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == 5 and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.id"].startswith("chatcmpl-") and a["gen_ai.response.model"] == name
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"] > 0
    children = {s.name: s for s in collector.spans if s.parent_span_id == span.span_id}
    assert set(children) == {"queue", "prefill", "decode"}
    assert children["queue"].start_time_unix_nano == span.start_time_unix_nano
    assert children["decode"].end_time_unix_nano == span.end_time_unix_nano
    assert children["prefill"].end_time_unix_nano == children["decode"].start_time_unix_nano


def test_no_endpoint_no_tracer(tiny_server):
    assert tiny_server.built.state.tracer is None
    assert type(tiny_server.built.async_engine.observer).__name__ == "ServerMetrics"
