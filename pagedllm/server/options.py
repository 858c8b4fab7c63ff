"""ServerOptions: what serving takes beyond the engine's config, each a knob() whose flag
`pagedllm serve` (and viz) builds from it, in the order of the fields.

This module imports nothing heavy (the parsers' registries only): the CLI reads it at parse
time, before the server stack (uvicorn, FastAPI, the engine) is imported."""
from __future__ import annotations

from dataclasses import dataclass

from ..knobs import knob, validate
from .parsers.reasoning import REASONING_PARSERS
from .parsers.tool_calls import TOOL_PARSERS

_TOOL_PARSERS = sorted(TOOL_PARSERS)
_REASONING_PARSERS = sorted(REASONING_PARSERS)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What serving takes beyond the engine's config, named as the `serve` flags are."""
    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(8000, "port to listen on", type=int)
    api_key: list[str] | None = knob(None, "accepted key (repeatable; or PAGEDLLM_API_KEY=k1,k2; default: none, "
                                     "no key needed)", action="append")
    admin_key: str | None = knob(None, "key for the visualizer's engine controls (pause, step, delay, scenarios) and "
                                 "for seeing every tenant's text in it (or PAGEDLLM_ADMIN_KEY); with API keys and no "
                                 "admin key the controls are off")
    served_model_name: str | None = knob(None, "model name clients send (default: from the model)")
    max_queue_len: int = knob(1024, "waiting requests beyond this get 503", type=int)
    # None: per-key where API keys are set, else none
    prefix_cache_isolation: str | None = knob(None, "per-key (default when keys are set): tenants never share "
                                              "cached blocks", choices=["none", "per-key"])
    max_body_bytes: int = knob(4 * 1024 * 1024, "larger request bodies get 413", type=int)
    metrics_prefix: str = knob("pagedllm", "name prefix of the /metrics series; 'vllm' serves vllm:* so vLLM's "
                               "Grafana dashboards work unchanged (default: %(default)s)")
    log_interval: float = knob(10.0, "seconds between status lines", type=float)
    graceful_shutdown_timeout: float = knob(
        30.0, "on SIGTERM, stop accepting and give in-flight requests this long to finish; then streams end with "
        "an error event and data: [DONE], other requests get 503 (default: %(default)g; vLLM's --shutdown-timeout "
        "defaults to 0)", type=float, ge=0, metavar="SECONDS", aliases=["--shutdown-timeout"])
    header_timeout: float = knob(10.0, "a connection must send complete request headers this soon, else 408 and "
                                 "closed (default: %(default)g)", type=float, gt=0, metavar="SECONDS")
    body_timeout: float = knob(30.0, "a request body must arrive this soon after its headers, else 408 "
                               "(default: %(default)g)", type=float, gt=0, metavar="SECONDS")
    limit_concurrency: int | None = knob(None, "API requests (/v1/...) in flight beyond N get 503 at once "
                                         "(default: no limit)", type=int, ge=1, metavar="N")
    enable_auto_tool_choice: bool = knob(False, 'serve tool_choice "auto" (the default when a chat request has '
                                         "tools): the model writes free text, the --tool-call-parser reads its "
                                         "calls (vLLM's flag)")
    tool_call_parser: str | None = knob(
        None, "what reads tool calls from the model's text under --enable-auto-tool-choice: "
        f"{', '.join(_TOOL_PARSERS)} (hermes: Hermes and Qwen's <tool_call> JSON; llama3_json: Llama 3.1's JSON; "
        "mistral: [TOOL_CALLS]; pythonic: Llama 3.2/4's [f(x=1)]; qwen3_coder: Qwen3-Coder's <function=...> XML; "
        "openai: gpt-oss's harmony messages to functions.NAME)",
        choices=_TOOL_PARSERS, metavar="NAME")
    lora_modules: list[str] | None = knob(
        None, "PEFT LoRA adapters served under their own model names (needs --enable-lora; vLLM's flag): "
        "name=path, or '{\"name\": ..., \"path\": ...}'; a request's model field picks one",
        nargs="+", metavar="NAME=PATH")
    reasoning_parser: str | None = knob(
        None, "split a reasoning model's <think>...</think> (openai_gptoss: gpt-oss's analysis channel) from its "
        "answer into chat's reasoning_content, and start a structured output's grammar after it (vLLM's flag): "
        + ", ".join(_REASONING_PARSERS),
        choices=_REASONING_PARSERS, metavar="NAME")
    otlp_traces_endpoint: str | None = knob(
        None, "send an OpenTelemetry trace of each request (an llm_request span with vLLM's gen_ai.* attributes, "
        "and its queue, prefill and decode) to this OTLP/HTTP endpoint, e.g. http://localhost:4318/v1/traces; a "
        "request's traceparent header joins the caller's trace (default: no tracing)", metavar="URL")
    max_stored_responses: int = knob(
        256, "Responses API: the responses kept per tenant (API key) for previous_response_id, oldest out, at "
        "most 64 MiB of them and 512 MiB over all tenants (a store past that is refused, never another "
        "tenant's evicted); 0 keeps none (default: %(default)s)", type=int, ge=0, metavar="N")
    # Not a serve flag: the command line's own --log-level, which uvicorn's logging follows too.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        validate(self)
