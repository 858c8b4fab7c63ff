"""What every route shares: the server's state (engine, keys, tenants, limits), the
OpenAI-shaped APIError, and reading a request body into checked JSON.

Bodies are read and validated here, not by FastAPI's automatic parsing, so that every
bad input (oversized, not UTF-8, not JSON, wrong type or range) gets an OpenAI-shaped
error naming what is wrong.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from ..engine.client import EngineClient
from .lora import ServedLoRAs
from .metrics import ServerMetrics
from .parsers.reasoning import REASONING_PARSERS
from .parsers.tool_calls import TOOL_PARSERS
from .responses.store import ResponseStore
from .shared_read import SharedRead
from .unsupported import unsupported_field

ISOLATION_MODES = ("none", "per-key")
SLOT_WALK_TTL_S = 1.0   # a /metrics scrape walks the block tables at most this often


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.status}}, status_code=self.status)


class ServerState:
    def __init__(self, engine: EngineClient, model_name: str, api_keys: list[str], isolation: str,
                 max_body_bytes: int, admin_key: str | None = None, body_timeout: float = 30.0,
                 metrics_prefix: str = "pagedllm", tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"prefix_cache_isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, "
                             f"got {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, "
                             f"got {reasoning_parser!r}")
        self.reasoning_parser = reasoning_parser   # None: the answer's text is all content
        self.engine = engine
        self.model_name = model_name
        self.api_keys = [k.encode() for k in api_keys]
        self.admin_key = admin_key.encode() if admin_key else None
        self.isolation = isolation
        self.tool_call_parser = tool_call_parser  # None: tool_choice "auto" is refused
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout  # seconds the whole body may take to arrive: no trickling
        self.closing = asyncio.Event()  # set when the shutdown grace is over (server.http.GracefulShutdown)
        # Fed by the engine thread: every request once, disconnects (aborts) included.
        self.metrics = ServerMetrics.for_engine(engine, model_name, metrics_prefix)
        self.tokenizer = engine.info.tokenizer
        self.walk_slots = SharedRead(engine.get_stats, SLOT_WALK_TTL_S)
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagedllm-request")
        self.loras = ServedLoRAs(model_name, None, False)   # launch.build sets the served ones
        self.responses = ResponseStore(0)   # launch.build sets the server's (Responses API: store)
        self.tracer = None   # a tracing.RequestTracer with --otlp-traces-endpoint

    # -- request checks ------------------------------------------------------
    def authenticate(self, request: Request, query_key: bool = False) -> str | None:
        """The caller's API key (None when the server has none). query_key also takes
        ?api_key=, for clients that cannot set headers (a browser's EventSource)."""
        auth = request.headers.get("authorization", "")
        # Anthropic's clients send their key as x-api-key
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not key and query_key:
            key = request.query_params.get("api_key", "")
        if self.is_admin(key):
            return key
        if not self.api_keys:
            return None
        if not any(hmac.compare_digest(key.encode(), k) for k in self.api_keys):
            how = "Authorization: Bearer <key> or x-api-key: <key>" + (", or ?api_key=<key>" if query_key else "")
            raise APIError(401, f"invalid or missing API key ({how})", "authentication_error")
        return key

    def is_admin(self, key: str | None) -> bool:
        return self.admin_key is not None and key is not None and hmac.compare_digest(key.encode(), self.admin_key)

    def may_control(self, key: str | None) -> bool:
        """Whether `key` is the operator's: engine controls (the visualizer's pause, step, delay,
        scenarios) slow every tenant and adapter changes change what every tenant is served, so
        only the admin key may, or anyone on a server without keys; the operator also sees adapter paths."""
        return self.is_admin(key) or (self.admin_key is None and not self.api_keys)

    def tenant(self, key: str | None) -> str | None:
        """A key's tenant label (never the key itself): who owns a request, for the
        visualizer. None on a server without keys, where everyone is one tenant."""
        return None if key is None else "tenant:" + hashlib.sha256(key.encode()).hexdigest()[:16]

    def cache_salt(self, key: str | None, requested: str | None) -> str | None:
        """Per-key isolation: the salt comes from the key, server-side, so one tenant can
        never hit (or time) another tenant's cached blocks; a request's own cache_salt
        only narrows further."""
        if self.isolation == "per-key" and key is not None:
            tenant = "tenant:" + hashlib.sha256(key.encode()).hexdigest()[:32]
            return tenant if requested is None else f"{tenant}|{requested}"
        return requested

    async def off_loop(self, fn, *args):
        """Run CPU-bound request work (JSON parsing, chat templates, tokenizing) on the
        worker threads: a 4 MB prompt must not stall other tenants' streams or /health.
        The tokenizer releases the GIL while it encodes."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    async def read_json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"request body is {length} bytes; the limit is {self.max_body_bytes}")
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > self.max_body_bytes:
                    raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        try:
            await asyncio.wait_for(read(), self.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"request body not received within {self.body_timeout:g} s") from None
        return await self.off_loop(_parse_json, bytes(body))

    def model_names(self) -> tuple[str, ...]:
        """Names a request may use: the served name, and while that is the default one
        (no --served-model-name), the --model argument as given too, as vLLM answers to."""
        info = self.engine.info
        names = (self.model_name, *self.loras.by_name)
        if self.model_name == info.model_name and info.model is not None:
            return (*names, str(info.model))
        return names

    def refuse_unsupported(self, model: type[BaseModel], data: dict, refused: dict) -> None:
        field = unsupported_field(model, data, refused)
        if field is not None:
            raise APIError(400, f"{field}: not supported by this server; leave it out", param=field)

    def parse(self, model: type[BaseModel], data: Any) -> Any:
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
        if req.model is not None and req.model not in self.model_names():
            served = ", ".join(f"`{n}`" for n in (self.model_name, *self.loras.by_name))
            raise APIError(404, f"the model `{req.model}` does not exist; this server serves {served}",
                           "NotFoundError", "model")
        return req


MAX_JSON_DEPTH = 32


def _parse_json(body: bytes) -> Any:
    """A request body as JSON, or APIError naming what is wrong with it (never a 500)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
    except RecursionError:
        raise APIError(400, f"request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)") \
            from None
    except ValueError as e:  # NaN / Infinity, or an integer past Python's digit limit
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    _check_tree(data)
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:40]} is out of the float range")
    return x


def _check_tree(data: Any) -> None:
    """Walk a parsed body without recursion: reject deep nesting (before pydantic recurses
    into it) and strings that are not Unicode text (lone surrogates, which JSON's \\u
    escapes allow but no tokenizer or encoder accepts)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if depth > MAX_JSON_DEPTH and isinstance(node, (dict, list)):
            raise APIError(400, f"request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)")
        if isinstance(node, dict):
            for k, v in node.items():
                _check_text(k)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _check_text(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"request body holds a string that is not valid Unicode text "
                                f"(a lone surrogate \\u{ord(s[e.start]):04x})") from None
