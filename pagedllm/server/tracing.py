"""OpenTelemetry traces of served requests (--otlp-traces-endpoint, as vLLM's): one
`llm_request` span per engine request, in the caller's trace when its HTTP request carries a
W3C `traceparent`, with vLLM's `gen_ai.*` attribute names, and three child spans, `queue`,
`prefill` and `decode`, drawn from the request's own timestamps. Exported over OTLP/HTTP
(protobuf) by the SDK's batch processor, off the engine's thread.

Spans carry metadata only (ids, sizes, times), never prompts or answers: a trace backend
is often shared more widely than the server. With no endpoint nothing here is imported or
called (the server registers no tracer), so tracing off costs nothing.
"""
from __future__ import annotations

import threading
from typing import Any

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

# vLLM's SpanAttributes (vllm/tracing.py): the names a dashboard built for vLLM reads.
A = {
    "model": "gen_ai.response.model", "id": "gen_ai.request.id", "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p", "max_tokens": "gen_ai.request.max_tokens", "n": "gen_ai.request.n",
    "prompt_tokens": "gen_ai.usage.prompt_tokens", "completion_tokens": "gen_ai.usage.completion_tokens",
    "num_sequences": "gen_ai.usage.num_sequences", "queue": "gen_ai.latency.time_in_queue",
    "ttft": "gen_ai.latency.time_to_first_token", "e2e": "gen_ai.latency.e2e",
    "prefill": "gen_ai.latency.time_in_model_prefill", "decode": "gen_ai.latency.time_in_model_decode",
    "inference": "gen_ai.latency.time_in_model_inference",
}


def _ns(t: float) -> int:
    return int(t * 1e9)


class RequestTracer:
    """A StepObserver that turns each finished request into spans. `begin` (on the event loop,
    at submit) keeps what the request asked and the caller's trace context until it ends."""

    def __init__(self, endpoint: str, model_name: str, headers: dict[str, str] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": "pagedllm"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, headers=headers)))
        self.tracer = self.provider.get_tracer("pagedllm")
        self.propagator = TraceContextTextMapPropagator()
        self.model_name = model_name
        self._pending: dict[str, tuple[Any, SamplingParams]] = {}
        self._lock = threading.Lock()   # begin on the event loop, on_finished on the engine's thread

    def begin(self, request_id: str, headers: Any, params: SamplingParams) -> None:
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        with self._lock:
            self._pending[request_id] = (self.propagator.extract(carrier) if carrier else None, params)

    def forget(self, request_id: str) -> None:
        """A request the engine never took (refused at submit): no span."""
        with self._lock:
            self._pending.pop(request_id, None)

    def on_step(self, outputs: list[RequestOutput], tokens: int, moved: list[str]) -> None:
        for out in outputs:   # spans are drawn once a request has ended, from its timestamps
            if out.finished:
                self.on_finished(out)

    def on_finished(self, out: RequestOutput) -> None:
        """A request ended (in a step, or aborted outside one): its spans, once."""
        with self._lock:
            ctx, params = self._pending.pop(out.request_id, (None, None))
        m = out.metrics
        arrival, done = m.get("arrival_time"), m.get("finish_time")
        if params is None or arrival is None or done is None:
            return   # not a request this server traced (or one that never ran)
        from opentelemetry.trace import SpanKind, set_span_in_context

        sched, first = m.get("scheduled_time") or done, m.get("first_token_time") or done
        gen = m.get("output_lens") or [len(c.token_ids) for c in out.outputs]
        attrs = {A["model"]: self.model_name, A["id"]: out.request_id, A["temperature"]: params.temperature,
                 A["top_p"]: params.top_p, A["n"]: params.n, A["prompt_tokens"]: len(out.prompt_token_ids),
                 A["completion_tokens"]: sum(gen), A["num_sequences"]: len(gen),
                 A["queue"]: sched - arrival, A["ttft"]: first - arrival, A["e2e"]: done - arrival,
                 A["prefill"]: first - sched, A["decode"]: done - first, A["inference"]: done - sched}
        if params.max_tokens is not None:
            attrs[A["max_tokens"]] = params.max_tokens
        span = self.tracer.start_span("llm_request", context=ctx, kind=SpanKind.SERVER, attributes=attrs,
                                      start_time=_ns(arrival))
        inner = set_span_in_context(span)
        for name, a, b in (("queue", arrival, sched), ("prefill", sched, first), ("decode", first, done)):
            self.tracer.start_span(name, context=inner, start_time=_ns(a)).end(end_time=_ns(max(a, b)))
        span.end(end_time=_ns(done))

    def shutdown(self) -> None:
        self.provider.shutdown()   # flushes what is batched


class Observers:
    """Several engine observers as one (the engine calls one): metrics, then tracing."""

    def __init__(self, *observers) -> None:
        self.observers = observers

    def on_step(self, outputs: list[RequestOutput], tokens: int, moved: list[str]) -> None:
        for o in self.observers:
            o.on_step(outputs, tokens, moved)

    def on_finished(self, out: RequestOutput) -> None:
        for o in self.observers:
            o.on_finished(out)
