"""The OpenAI-compatible app: `create_app(state)` and its route handlers.

Each handler authenticates, reads its body (pagedllm.server.state), prepares the request
on the worker threads and hands it to pagedllm.server.streaming. The app knows nothing of
the visualizer: the CLI mounts its routes on the app when --viz is on.
"""
from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from .. import __version__
from .anthropic.api import count_tokens, create_message
from .anthropic.schemas import CountTokensBody, MessagesBody
from .info import model_info, server_info
from .lora import RUNTIME_FLAG, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, runtime_updates_allowed
from .openai.pooling import EmbeddingRequest, RerankRequest, ScoreRequest, embeddings, rerank, score
from .openai.protocol import ChatCompletionRequest, CompletionRequest
from .openai.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from .prepare import check_structured, detokenize_body, prepare_chat, prepare_completion, tokenize_body
from .responses.api import create_response, delete_response, get_response
from .responses.schemas import ResponsesBody
from .state import APIError, ServerState
from .streaming import serve

logger = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    """The OpenAI routes, /health, /version, /metrics, /model_info and /server_info."""
    app = FastAPI(title="PagedLLM", version=__version__)
    app.state.pagedllm = state
    _add_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _add_responses_routes(app, state)
    _add_messages_routes(app, state)
    _add_pooling_routes(app, state)
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
        key = state.authenticate(request)
        s, now = state.engine.stats, int(time.time())
        base = {"id": state.model_name, "object": "model", "created": now, "owned_by": "pagedllm",
                "max_model_len": state.engine.info.max_model_len, "kv_cache_blocks": s.kv.num_blocks,
                "block_size": s.kv.block_size}
        # adapters as vLLM lists them, the base as parent; their path as root for the operator only
        # (a tenant learns nothing of the server's file system), their name for everyone else
        operator = state.may_control(key)
        return {"object": "list", "data": [base] + [
            {"id": name, "object": "model", "created": now, "owned_by": "pagedllm",
             "root": r.lora_path if operator else name, "parent": state.model_name,
             "max_model_len": base["max_model_len"]}
            for name, r in list(state.loras.by_name.items())]}

    @app.post("/v1/load_lora_adapter", openapi_extra=_body(LoadLoRAAdapterRequest))
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

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request):
        body = await _lora_admin(state, request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
        try:
            state.loras.remove(name)
        except KeyError:
            raise APIError(404, f"the adapter {name!r} is not served", "NotFoundError", "lora_name") from None
        except PermissionError:
            raise APIError(403, f"the adapter {name!r} is served by --lora-modules: it cannot be unloaded at run "
                           "time", "permission_error", "lora_name") from None
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
        req, params, prompts, echo = await state.off_loop(prepare_completion, state, body)
        await check_structured(state, req, params, key)
        return await serve(state, request, req, "cmpl", prompts, params, key, chat=False, echo=echo)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        key = state.authenticate(request)
        body = await state.read_json(request)
        req, params, prompts, tools = await state.off_loop(prepare_chat, state, body)
        await check_structured(state, req, params, key)
        return await serve(state, request, req, "chatcmpl", prompts, params, key, chat=True, tools=tools)


def _add_responses_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses", openapi_extra=_body(ResponsesBody))
    async def responses(request: Request):
        return await create_response(state, request)

    @app.get("/v1/responses/{response_id}")
    async def responses_get(request: Request, response_id: str):
        return get_response(state, request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(request: Request, response_id: str):
        return delete_response(state, request, response_id)


def _add_messages_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages", openapi_extra=_body(MessagesBody))
    async def messages(request: Request):
        return await create_message(state, request)

    @app.post("/v1/messages/count_tokens", openapi_extra=_body(CountTokensBody))
    async def messages_count_tokens(request: Request):
        return await count_tokens(state, request)


def _add_pooling_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings", openapi_extra=_body(EmbeddingRequest))
    async def embeddings_route(request: Request):
        return await embeddings(state, request)

    @app.post("/score", openapi_extra=_body(ScoreRequest))
    @app.post("/v1/score", include_in_schema=False)
    async def score_route(request: Request):
        return await score(state, request)

    @app.post("/rerank", openapi_extra=_body(RerankRequest))
    @app.post("/v1/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    async def rerank_route(request: Request):
        return await rerank(state, request)


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize", openapi_extra=_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize_route(request: Request):
        state.authenticate(request)
        body = await state.read_json(request)
        return await state.off_loop(tokenize_body, state, body)

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize_route(request: Request):
        state.authenticate(request)
        body = await state.read_json(request)
        return await state.off_loop(detokenize_body, state, body)


BODIES = (CompletionRequest, ChatCompletionRequest, ResponsesBody, MessagesBody, CountTokensBody, EmbeddingRequest,
          ScoreRequest, RerankRequest, TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest,
          LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)


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


async def _lora_admin(state: ServerState, request: Request) -> dict:
    """The body of a runtime adapter change, once the server allows them (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING) and the caller may: an adapter changes what every tenant is
    served, so wherever the server has API keys only the admin key may (with keys and no admin
    key, nobody); a server with no keys at all is one user's."""
    key = state.authenticate(request)
    if not runtime_updates_allowed():
        raise APIError(404, f"runtime adapter updates are off; start the server with {RUNTIME_FLAG}=True",
                       "NotFoundError")
    if not state.may_control(key):
        why = "" if state.admin_key is not None else " (this server has API keys and no --admin-key: none may)"
        raise APIError(403, f"runtime adapter updates need the admin key{why}", "permission_error")
    body = await state.read_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body
