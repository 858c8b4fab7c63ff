"""The OpenAI-compatible app: `create_app(state)` and its route handlers.

Each handler authenticates, reads its body (pagedllm.server.state), prepares the request
on the worker threads and hands it to pagedllm.server.streaming. The app knows nothing of
the visualizer: the CLI mounts its routes on the app when --viz is on.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from .. import __version__
from ..engine.client import EngineDeadError
from ..sampling_params import SamplingParams
from .chat_template import render_chat
from .info import model_info, server_info
from .lora import RUNTIME_FLAG, runtime_updates_allowed
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import APIError, ServerState
from .streaming import serve
from .tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize, tokenize
from .tool_output import ToolOutput
from .tool_parsers import TOOL_PARSERS
from .tools import tool_dicts
from .unsupported import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED

logger = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    """The OpenAI routes, /health, /version, /metrics, /model_info and /server_info."""
    app = FastAPI(title="PagedLLM", version=__version__)
    app.state.pagedllm = state
    _add_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _add_token_routes(app, state)
    app.openapi = lambda: _openapi(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        logger.exception("internal error")
        return APIError(500, f"internal error: {type(e).__name__}", "internal_error").response()


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
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
        # The KV slot figures (eta) walked between two steps, at most once a second however
        # often anyone scrapes; the counters are the latest step's.
        await state.walk_slots()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        state.authenticate(request)
        s, now = state.engine.stats, int(time.time())
        base = {"id": state.model_name, "object": "model", "created": now, "owned_by": "pagedllm",
                "max_model_len": state.engine.info.max_model_len, "kv_cache_blocks": s.kv.num_blocks,
                "block_size": s.kv.block_size}
        # adapters as vLLM lists them: their path as root, the base as parent
        return {"object": "list", "data": [base] + [
            {"id": name, "object": "model", "created": now, "owned_by": "pagedllm", "root": r.lora_path,
             "parent": state.model_name, "max_model_len": base["max_model_len"]}
            for name, r in list(state.loras.by_name.items())]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _lora_admin(state, request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(400, "lora_name and lora_path must be non-empty strings")
        try:
            await state.off_loop(state.loras.add, name, path)   # reads the files: off the event loop
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _lora_admin(state, request)
        name = body.get("lora_name")
        try:
            state.loras.remove(name)
        except KeyError:
            raise APIError(404, f"the adapter {name!r} is not served", "NotFoundError", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # What a gateway reads of a worker (the SGLang Model Gateway names a model by them),
    # under SGLang's paths and their older get_ names; behind the same keys as /v1/models.
    @app.get("/model_info")
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info_route(request: Request):
        state.authenticate(request)
        return model_info(state.engine.info)

    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)
    async def server_info_route(request: Request):
        state.authenticate(request)
        return server_info(state.engine.info, state.model_name, state.engine.stats.kv.num_blocks)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request):
        key = state.authenticate(request)
        body = await state.read_json(request)
        req, params, prompts, echo = await state.off_loop(_prepare_completion, state, body)
        await _check_structured(state, req, params)
        return await serve(state, request, req, "cmpl", prompts, params, key, chat=False, echo=echo)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        key = state.authenticate(request)
        body = await state.read_json(request)
        req, params, prompts, tools = await state.off_loop(_prepare_chat, state, body)
        await _check_structured(state, req, params)
        return await serve(state, request, req, "chatcmpl", prompts, params, key, chat=True, tools=tools)


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
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
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens: 0 returns nothing without echo (echo: true answers the prompt alone, "
                            "with its logprobs); ask for at least 1", param="max_tokens")
    _check_prompt_logprobs(req)
    # The engine samples at least one token: a prompt-only answer drops it (ResponseBuilder).
    max_tokens = 1 if req.prompt_only else req.max_tokens
    params = _params(req, max_tokens, req.logprobs, req.engine_prompt_logprobs())
    prompts = req.prompts()
    ids = _token_ids(state, prompts, params, chat=False)
    # echo: each choice's text starts with its prompt's, as OpenAI's and vLLM's do.
    echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in prompts] if req.echo else None
    return req, params, ids, echo


def _prepare_chat(state: ServerState, body: Any):
    req: ChatCompletionRequest = state.parse(ChatCompletionRequest, body)
    state.refuse_unsupported(ChatCompletionRequest, body, CHAT_UNSUPPORTED)
    _check_prompt_logprobs(req)
    tools = _tool_output(state, req)
    try:
        prompt = render_chat(state.tokenizer, req.conversation(), req.add_generation_prompt, tool_dicts(req.tools),
                             req.chat_template_kwargs)
    except ValueError as e:
        raise _bad(e) from None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(req, req.max_completion_tokens or req.max_tokens, logprobs, req.prompt_logprobs)
    if tools is not None and isinstance(params, SamplingParams) and tools.needs_special_tokens(state.tokenizer):
        params.skip_special_tokens = False
    return req, params, _token_ids(state, [prompt], params, chat=True), tools


def _tool_output(state: ServerState, req: ChatCompletionRequest) -> ToolOutput | None:
    """How the answer's text becomes tool calls, or None for plain text."""
    try:
        mode = req.tool_mode()
    except ValueError as e:
        raise _bad(e) from None
    if mode == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    if mode != "auto":
        return ToolOutput(mode, name=req.named_tool, parallel=parallel)
    if state.tool_call_parser is None:
        raise APIError(400, 'tool_choice: "auto" (the default when tools are given) needs the server started '
                            "with --enable-auto-tool-choice and --tool-call-parser; or ask for \"required\", "
                            "a named function, or \"none\"", param="tool_choice")
    return ToolOutput("auto", parser=TOOL_PARSERS[state.tool_call_parser], parallel=parallel)


async def _check_structured(state: ServerState, req, params) -> None:
    """A constrained request's grammar is compiled (or found cached) before it is queued: a
    bad schema, regex or grammar is a 400, streaming or not, and never reaches a step."""
    if not isinstance(params, SamplingParams) or params.structured_outputs is None:
        return
    try:
        await state.engine.check_structured(params.structured_outputs)
    except ValueError as e:
        field = req.constraint()[0]
        if field == "tool_choice":  # the forced call's schema is made of the tools' parameters
            raise APIError(400, f"tools: their parameters cannot constrain a call ({e})", param="tools") from None
        raise APIError(400, f"{field}: {e}", param=field) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), "service_unavailable") from None


def _check_prompt_logprobs(req) -> None:
    # vLLM's rule: the field is a whole-response one (the echoed prompt's logprobs do stream).
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs: not available with stream: true", param="prompt_logprobs")


def _tokenize(state: ServerState, body: Any) -> dict:
    chat = isinstance(body, dict) and "messages" in body  # vLLM's two shapes, told apart as it does
    req = state.parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    try:
        return tokenize(state.engine.info, state.tokenizer, req)
    except ValueError as e:
        raise _bad(e, "messages" if chat else "prompt") from None


def _detokenize(state: ServerState, body: Any) -> dict:
    req = state.parse(DetokenizeRequest, body)
    try:
        return detokenize(state.engine.info, state.tokenizer, req)
    except ValueError as e:
        raise APIError(400, str(e), param="tokens") from None


def _params(req, max_tokens, logprobs, prompt_logprobs=None):
    try:
        return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:
        raise _bad(e) from None


def _bad(e: ValueError, param: str | None = None) -> APIError:
    """A 400 for a ValueError, naming the field a FieldError carries."""
    return APIError(400, str(e), param=getattr(e, "param", param))


def _token_ids(state: ServerState, prompts: list, params, chat: bool) -> list[list[int]]:
    """Every prompt's token ids, checked against the limits; all or nothing, so no
    request is queued when one prompt of the batch is bad. A completion's text gets the
    tokenizer's special tokens (BOS), as vLLM's; a chat template's text already has them."""
    out = []
    for i, p in enumerate(prompts):
        try:
            out.append(state.engine.validate(p, params, add_special_tokens=not chat))
        except ValueError as e:
            message, param = _limit_field(str(e), chat)
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise APIError(400, where + message, param=param or ("messages" if chat else "prompt")) from None
    return out


def _limit_field(message: str, chat: bool) -> tuple[str, str | None]:
    """The request field a top-k limit error is about (the engine names its SamplingParams
    field; chat's per-token k is top_logprobs)."""
    for name in ("prompt_logprobs", "logprobs"):
        if message.startswith(name + ":"):
            field = "top_logprobs" if chat and name == "logprobs" else name
            return field + message[len(name):], field
    return message, None


async def _lora_admin(state: ServerState, request: Request) -> dict:
    """The body of a runtime adapter change, once the server allows them (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING) and the caller may: the admin key where the server has one
    (an adapter changes what every tenant may ask for), else any accepted key."""
    key = state.authenticate(request)
    if not runtime_updates_allowed():
        raise APIError(404, f"runtime adapter updates are off; start the server with {RUNTIME_FLAG}=True",
                       "NotFoundError")
    if state.admin_key is not None and not state.is_admin(key):
        raise APIError(403, "runtime adapter updates need the admin key", "permission_error")
    body = await state.read_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body
