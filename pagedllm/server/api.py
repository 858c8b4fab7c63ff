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
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from .. import __version__
from ..engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from ..outputs import CompletionOutput, RequestOutput
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest

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
                 max_body_bytes: int) -> None:
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"prefix_cache_isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
        self.engine = engine
        self.model_name = model_name
        self.api_keys = [k.encode() for k in api_keys]
        self.isolation = isolation
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(lambda: engine.stats, model_name)
        self.tokenizer = engine.engine.tokenizer

    # -- request checks ------------------------------------------------------
    def authenticate(self, request: Request, query_key: bool = False) -> str | None:
        """The caller's API key (None when the server has none). query_key also takes
        ?api_key=, for clients that cannot set headers (a browser's EventSource)."""
        if not self.api_keys:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not key and query_key:
            key = request.query_params.get("api_key", "")
        if not any(hmac.compare_digest(key.encode(), k) for k in self.api_keys):
            how = "Authorization: Bearer <key>" + (", or ?api_key=<key>" if query_key else "")
            raise APIError(401, f"invalid or missing API key ({how})", "authentication_error")
        return key

    def cache_salt(self, key: str | None, requested: str | None) -> str | None:
        """Per-key isolation: the salt comes from the key, server-side, so one tenant can
        never hit (or time) another tenant's cached blocks; a request's own cache_salt
        only narrows further."""
        if self.isolation == "per-key" and key is not None:
            tenant = "tenant:" + hashlib.sha256(key.encode()).hexdigest()[:32]
            return tenant if requested is None else f"{tenant}|{requested}"
        return requested

    async def read_json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"request body is {length} bytes; the limit is {self.max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(400, f"request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise APIError(400, f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
                from None

    def parse(self, model: type[BaseModel], data: Any) -> Any:
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
        if req.model != self.model_name:
            raise APIError(404, f"the model `{req.model}` does not exist; this server serves `{self.model_name}`",
                           "NotFoundError", "model")
        return req


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
            "max_model_len": state.engine.engine.max_model_len, "kv_cache_blocks": s.num_blocks,
            "block_size": s.block_size}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        key = state.authenticate(request)
        req: CompletionRequest = state.parse(CompletionRequest, await state.read_json(request))
        params = _params(req, req.max_tokens, req.logprobs)
        prompts = req.prompts()
        return await _serve(state, request, req, "cmpl", prompts, params, state.cache_salt(key, req.cache_salt),
                            chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        key = state.authenticate(request)
        req: ChatCompletionRequest = state.parse(ChatCompletionRequest, await state.read_json(request))
        try:
            conv = req.conversation()
            prompt = state.tokenizer.apply_chat_template(conv, tokenize=False,
                                                         add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        except Exception as e:  # a template that rejects this conversation (e.g. role order)
            raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, max_tokens, logprobs)
        return await _serve(state, request, req, "chatcmpl", [prompt], params,
                            state.cache_salt(key, req.cache_salt), chat=True)

    if viz is not None:
        from ..viz.routes import add_viz_routes
        add_viz_routes(app, state, viz)
    return app


def _params(req, max_tokens, logprobs):
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def _serve(state: ServerState, request: Request, req, prefix: str, prompts: list, params, salt,
                 chat: bool):
    engine = state.engine
    for i, p in enumerate(prompts):  # all or nothing: no request is queued if one is bad
        try:
            engine.validate(p, params)
        except ValueError as e:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise APIError(400, where + str(e), param="messages" if chat else "prompt") from None
    rid = f"{prefix}-{uuid.uuid4().hex}"
    streams = []
    try:
        for i, p in enumerate(prompts):
            streams.append(engine.submit(f"{rid}-{i}", p, params, salt))
    except (QueueFullError, EngineDeadError) as e:
        for s in streams:
            await s.aclose()
        raise APIError(503, str(e), "service_unavailable") from None
    except ValueError as e:
        for s in streams:
            await s.aclose()
        raise APIError(400, str(e)) from None
    resp = _Response(state, req, rid, chat, params.n)
    if req.stream:
        return StreamingResponse(resp.sse(_merge(streams)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collect = asyncio.ensure_future(resp.collect(_merge(streams)))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    if collect not in done:  # the client left: abort its requests, free their blocks
        collect.cancel()
        await asyncio.gather(collect, return_exceptions=True)
        return Response(status_code=499)
    watch.cancel()
    return collect.result()


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

    def __init__(self, state: ServerState, req, rid: str, chat: bool, n: int) -> None:
        self.state, self.req, self.rid, self.chat, self.n = state, req, rid, chat, n
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.tok = state.tokenizer
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
                self.state.metrics.observe(out)
        choices = []
        for i in sorted(finals):
            for c in finals[i].outputs:
                ch: dict[str, Any] = {"index": self._index(i, c), "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}
                if self.chat:
                    ch["message"] = {"role": "assistant", "content": c.text}
                    ch["logprobs"] = self._chat_logprobs(c.logprobs) if c.logprobs is not None else None
                else:
                    ch["text"] = c.text
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
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
                    self.state.metrics.observe(out)
                for c in out.outputs:
                    idx = self._index(i, c)
                    done = c.finish_reason is not None
                    if idx not in sent_text:
                        sent_text[idx], sent_lp[idx] = 0, 0
                        if self.chat:  # OpenAI opens each choice with the assistant role
                            yield self._chunk(chunk_obj, idx, {"role": "assistant", "content": ""}, None, None)
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

    def _piece(self, token_id: int) -> str:
        return self.tok.convert_tokens_to_string([self.tok.convert_ids_to_tokens(token_id)])

    def _chat_logprobs(self, lps) -> dict:
        content = []
        for lp in lps:
            tok = self._piece(lp.token_id)
            content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": (t := self._piece(i)), "logprob": v, "bytes": list(t.encode())}
                                             for i, v in lp.top]})
        return {"content": content}

    def _completion_logprobs(self, lps) -> dict:
        tokens = [self._piece(lp.token_id) for lp in lps]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._piece(i): v for i, v in lp.top} for lp in lps], "text_offset": offsets}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
