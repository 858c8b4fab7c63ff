"""OpenAI-compatible routes over the async engine.

Request bodies are read and validated here, not by FastAPI's automatic parsing, so
that every bad input (oversized, not UTF-8, not JSON, wrong type or range) gets an
OpenAI-shaped error naming what is wrong.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from .. import __version__
from ..engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestFailedError
from ..outputs import CompletionOutput, Logprob, RequestOutput
from .http import ServerClosing, until, until_closing
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize, tokenize
from .unsupported import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, unsupported_field

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("none", "per-key")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.status}}, status_code=self.status)


class ServerState:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, api_keys: list[str], isolation: str,
                 max_body_bytes: int, admin_key: str | None = None, body_timeout: float = 30.0,
                 metrics_prefix: str = "pagedllm") -> None:
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"prefix_cache_isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
        self.engine = engine
        self.model_name = model_name
        self.api_keys = [k.encode() for k in api_keys]
        self.admin_key = admin_key.encode() if admin_key else None
        self.isolation = isolation
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout  # seconds the whole body may take to arrive: no trickling
        self.closing = asyncio.Event()  # set when the shutdown grace is over (server.http.GracefulShutdown)
        # Fed by the engine thread: every request once, disconnects (aborts) included.
        self.metrics = ServerMetrics.for_engine(engine, model_name, metrics_prefix)
        self.tokenizer = engine.engine.tokenizer
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagedllm-request")

    # -- request checks ------------------------------------------------------
    def authenticate(self, request: Request, query_key: bool = False) -> str | None:
        """The caller's API key (None when the server has none). query_key also takes
        ?api_key=, for clients that cannot set headers (a browser's EventSource)."""
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not key and query_key:
            key = request.query_params.get("api_key", "")
        if self.is_admin(key):
            return key
        if not self.api_keys:
            return None
        if not any(hmac.compare_digest(key.encode(), k) for k in self.api_keys):
            how = "Authorization: Bearer <key>" + (", or ?api_key=<key>" if query_key else "")
            raise APIError(401, f"invalid or missing API key ({how})", "authentication_error")
        return key

    def is_admin(self, key: str | None) -> bool:
        return self.admin_key is not None and key is not None and hmac.compare_digest(key.encode(), self.admin_key)

    def may_control(self, key: str | None) -> bool:
        """Engine controls (the visualizer's pause, step, delay, scenarios) slow every
        tenant: only the admin key may use them, or anyone on a server without keys."""
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
        engine = self.engine.engine
        if self.model_name == engine.model_name and engine.cfg.model is not None:
            return self.model_name, str(engine.cfg.model)
        return (self.model_name,)

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
            raise APIError(404, f"the model `{req.model}` does not exist; this server serves `{self.model_name}`",
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


def create_app(state: ServerState, viz=None) -> FastAPI:
    """The OpenAI routes, /metrics, and with `viz` (a VizHub) the visualizer at /viz/."""
    app = FastAPI(title="PagedLLM", version=__version__)
    app.state.pagedllm = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        logger.exception("internal error")
        return APIError(500, f"internal error: {type(e).__name__}", "internal_error").response()

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        state.authenticate(request)
        s = state.engine.stats
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "pagedllm",
            "max_model_len": state.engine.engine.max_model_len, "kv_cache_blocks": s.kv.num_blocks,
            "block_size": s.kv.block_size}]}

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request):
        key = state.authenticate(request)
        body = await state.read_json(request)
        req, params, prompts, echo = await state.off_loop(_prepare_completion, state, body)
        return await _serve(state, request, req, "cmpl", prompts, params, key, chat=False, echo=echo)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        key = state.authenticate(request)
        body = await state.read_json(request)
        req, params, prompts = await state.off_loop(_prepare_chat, state, body)
        return await _serve(state, request, req, "chatcmpl", prompts, params, key, chat=True)

    @app.post("/tokenize", openapi_extra=_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize_route(request: Request):
        state.authenticate(request)
        body = await state.read_json(request)
        return await state.off_loop(_tokenize, state, body)

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize_route(request: Request):
        state.authenticate(request)
        body = await state.read_json(request)
        return await state.off_loop(_detokenize, state, body)

    if viz is not None:
        from ..viz.routes import add_viz_routes
        add_viz_routes(app, state, viz)
    app.openapi = lambda: _openapi(app)
    return app


BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
          DetokenizeRequest)


def _body(*models: type[BaseModel]) -> dict:
    """The request body in the OpenAPI schema: routes read their bodies themselves (for
    OpenAI-shaped errors), so FastAPI would not list them; clients and fuzzers need them.
    Several models: the body is any one of them."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in BODIES:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


# -- request preparation: on the worker threads, never on the event loop -----------------
def _prepare_completion(state: ServerState, body: Any):
    req: CompletionRequest = state.parse(CompletionRequest, body)
    state.refuse_unsupported(CompletionRequest, body, COMPLETION_UNSUPPORTED)
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo: not supported together with logprobs (this server computes no prompt "
                            "logprobs)", param="echo")
    params = _params(req, req.max_tokens, req.logprobs)
    prompts = req.prompts()
    ids = _token_ids(state, prompts, params, chat=False)
    # echo: each choice's text starts with its prompt's, as OpenAI's and vLLM's do.
    echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in prompts] if req.echo else None
    return req, params, ids, echo


def _prepare_chat(state: ServerState, body: Any):
    req: ChatCompletionRequest = state.parse(ChatCompletionRequest, body)
    state.refuse_unsupported(ChatCompletionRequest, body, CHAT_UNSUPPORTED)
    try:
        conv = req.conversation()
        prompt = state.tokenizer.apply_chat_template(conv, tokenize=False,
                                                     add_generation_prompt=req.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    except Exception as e:  # a template that rejects this conversation (e.g. role order)
        raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(req, req.max_completion_tokens or req.max_tokens, logprobs)
    return req, params, _token_ids(state, [prompt], params, chat=True)


def _tokenize(state: ServerState, body: Any) -> dict:
    chat = isinstance(body, dict) and "messages" in body  # vLLM's two shapes, told apart as it does
    req = state.parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    try:
        return tokenize(state.engine.engine, state.tokenizer, req)
    except ValueError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None


def _detokenize(state: ServerState, body: Any) -> dict:
    req = state.parse(DetokenizeRequest, body)
    try:
        return detokenize(state.engine.engine, state.tokenizer, req)
    except ValueError as e:
        raise APIError(400, str(e), param="tokens") from None


def _params(req, max_tokens, logprobs):
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _token_ids(state: ServerState, prompts: list, params, chat: bool) -> list[list[int]]:
    """Every prompt's token ids, checked against the limits; all or nothing, so no
    request is queued when one prompt of the batch is bad. A completion's text gets the
    tokenizer's special tokens (BOS), as vLLM's; a chat template's text already has them."""
    out = []
    for i, p in enumerate(prompts):
        try:
            out.append(state.engine.validate(p, params, add_special_tokens=not chat))
        except ValueError as e:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise APIError(400, where + str(e), param="messages" if chat else "prompt") from None
    return out


async def _serve(state: ServerState, request: Request, req, prefix: str, prompts: list[list[int]], params,
                 key: str | None, chat: bool, echo: list[str] | None = None):
    engine = state.engine
    salt = state.cache_salt(key, req.cache_salt)
    rid = f"{prefix}-{uuid.uuid4().hex}"
    streams = []
    try:
        for i, ids in enumerate(prompts):
            streams.append(engine.submit(f"{rid}-{i}", ids, params, salt, owner=state.tenant(key)))
    except (QueueFullError, EngineDeadError) as e:
        for s in streams:
            await s.aclose()
        raise APIError(503, str(e), "service_unavailable") from None
    except ValueError as e:
        for s in streams:
            await s.aclose()
        raise APIError(400, str(e)) from None
    resp = _Response(state, req, rid, chat, params.n, echo)
    # A client that leaves (before its first token, too: a long prefill sends nothing)
    # aborts its requests and frees their blocks before the next step.
    merged = until(_merge(streams), _wait_disconnect(request), ClientGone)
    if req.stream:
        return StreamingResponse(resp.sse(merged), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await resp.collect(merged)
    except ClientGone:
        return Response(status_code=499)
    except RequestFailedError as e:
        raise APIError(500, str(e), "internal_error") from None
    except EngineDeadError as e:
        raise APIError(503, str(e), "service_unavailable") from None


class ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' streams as (prompt index, output); closing this
    closes (and so aborts) every one still open."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except Exception as e:
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item = await q.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Response:
    """Builds OpenAI responses and SSE chunks from engine outputs."""

    def __init__(self, state: ServerState, req, rid: str, chat: bool, n: int, echo: list[str] | None = None) -> None:
        self.state, self.req, self.rid, self.chat, self.n = state, req, rid, chat, n
        self.echo = echo  # per prompt: the text each of its choices starts with
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.stops = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])

    def _index(self, prompt_idx: int, c: CompletionOutput) -> int:
        return prompt_idx * self.n + c.index

    def usage(self, finals: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def collect(self, merged) -> dict:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merged:
            if out.finished:
                finals[i] = out
        choices = []
        for i in sorted(finals):
            for c in finals[i].outputs:
                ch: dict[str, Any] = {"index": self._index(i, c), "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}
                if self.chat:
                    ch["message"] = {"role": "assistant", "content": c.text}
                    ch["logprobs"] = self._chat_logprobs(c.logprobs) if c.logprobs is not None else None
                else:
                    ch["text"] = (self.echo[i] if self.echo else "") + c.text
                    ch["logprobs"] = self._completion_logprobs(c.logprobs) if c.logprobs is not None else None
                choices.append(ch)
        choices.sort(key=lambda ch: ch["index"])
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.state.model_name,
                "choices": choices, "usage": self.usage(finals)}

    async def sse(self, merged) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        chunk_obj = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            async for i, out in until_closing(merged, self.state.closing):
                if out.finished:
                    finals[i] = out
                for c in out.outputs:
                    idx = self._index(i, c)
                    done = c.finish_reason is not None
                    if idx not in sent_text:
                        sent_text[idx], sent_lp[idx] = 0, 0
                        if self.chat:  # OpenAI opens each choice with the assistant role
                            yield self._chunk(chunk_obj, idx, {"role": "assistant", "content": ""}, None, None)
                        elif self.echo:  # the prompt comes first, in a chunk of its own
                            yield self._chunk(chunk_obj, idx, self.echo[i], None, None)
                    text = c.text
                    end = len(text) if done else self._safe_len(text)
                    delta = text[sent_text[idx]:end]
                    lps = (c.logprobs or [])[sent_lp[idx]:] if c.logprobs is not None else None
                    if not delta and not done and not lps:
                        continue
                    sent_text[idx] = max(sent_text[idx], end)
                    if lps:
                        sent_lp[idx] += len(lps)
                    yield self._chunk(chunk_obj, idx, delta, c.finish_reason if done else None, lps,
                                      c.stop_reason if done else None)
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                yield _sse({"id": self.rid, "object": chunk_obj, "created": self.created,
                            "model": self.state.model_name, "choices": [], "usage": self.usage(finals)})
            yield "data: [DONE]\n\n"
        except ServerClosing as e:  # the shutdown grace is over: end cleanly, the requests aborted
            yield _sse({"error": {"message": str(e), "type": "service_unavailable", "param": None, "code": 503}})
            yield "data: [DONE]\n\n"
        except ClientGone:  # nobody to tell; its requests are aborted
            return
        except Exception as e:  # after the headers went out, errors travel in the stream
            logger.warning("stream %s failed: %s", self.rid, e)
            yield _sse({"error": {"message": str(e), "type": "internal_error", "param": None, "code": 500}})
            yield "data: [DONE]\n\n"

    def _safe_len(self, text: str) -> int:
        """How much of a running sequence's text can go out: hold back a tail that may
        still become a stop string, and an incomplete UTF-8 character."""
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        if self.stops:
            end = max(0, min(end, len(text) - max(len(s) for s in self.stops) + 1))
        return end

    def _chunk(self, obj: str, idx: int, delta, finish, lps, stop_reason=None) -> str:
        choice: dict[str, Any] = {"index": idx, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice["logprobs"] = self._chat_logprobs(lps) if lps else None
        else:
            choice["text"] = delta
            choice["logprobs"] = self._completion_logprobs(lps) if lps else None
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return _sse({"id": self.rid, "object": obj, "created": self.created, "model": self.state.model_name,
                     "choices": [choice]})

    def _top(self, lp: dict) -> list[tuple[int, Logprob]]:
        """The k most likely of an output token's logprobs (the chosen one comes first and
        may be outside them), by rank."""
        k = (self.req.top_logprobs or 0) if self.chat else self.req.logprobs
        return sorted(((i, v) for i, v in lp.items() if v.rank is not None and v.rank <= k), key=lambda e: e[1].rank)

    def _chat_logprobs(self, lps) -> dict:
        content = []
        for lp in lps:
            chosen = lp[next(iter(lp))]
            tok = chosen.decoded_token  # decoded once, by the engine
            content.append({"token": tok, "logprob": chosen.logprob, "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": (t := v.decoded_token), "logprob": v.logprob,
                                              "bytes": list(t.encode())} for _, v in self._top(lp)]})
        return {"content": content}

    def _completion_logprobs(self, lps) -> dict:
        chosen = [lp[next(iter(lp))] for lp in lps]
        tokens = [c.decoded_token for c in chosen]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [c.logprob for c in chosen],
                "top_logprobs": [{v.decoded_token: v.logprob for _, v in self._top(lp)} for lp in lps],
                "text_offset": offsets}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
