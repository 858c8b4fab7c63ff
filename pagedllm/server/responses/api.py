"""POST /v1/responses (OpenAI's Responses API), with GET and DELETE of a stored response.

A request is made into a chat completion request (request.py), prepared, checked
and queued exactly as one (prepare.py, streaming.submit), and its chat answer, whole or
streamed, made into the Responses shapes (output.py). With `store` (the default,
as OpenAI's) the conversation is kept for `previous_response_id`, per tenant
(store.py)."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..openai.structured import FieldError
from ..prepare import check_structured, prepare_chat, renamed
from ..state import APIError, ServerState
from ..streaming import ClientGone, ResponseBuilder, event_stream, submit, translated, whole
from .output import ResponsesEvents, ResponseShape, assistant_messages, new_id
from .request import (CHAT_TO_RESPONSES, REFUSED, TRUNCATION, ResponsesRequest, chat_body,
                                input_messages)
from .store import StoredResponse


async def create_response(state: ServerState, request: Request):
    key = state.authenticate(request)
    body = await state.read_json(request)
    req, convo, chat_req, params, prompts, tools = await state.off_loop(_prepare, state, body, key)
    try:
        await check_structured(state, chat_req, params, key)
    except APIError as e:
        raise renamed(e, CHAT_TO_RESPONSES) from None
    sub = await submit(state, request, chat_req, "resp", prompts, params, key)
    builder = ResponseBuilder(state, chat_req, sub.rid, True, 1, None, tools, sub.lora_name)
    shape = ResponseShape(req, new_id("resp"), builder.model, [dict(t, type="function") for t in
                                                                 _tool_dicts(chat_req)])
    tenant = state.tenant(key)

    def keep(response: dict) -> None:
        """Stores the response (before it goes out: a refused store says store: false in it)."""
        if req.store:
            messages = convo + assistant_messages(response["output"])
            if not state.responses.put(tenant, response["id"], StoredResponse.of(response, messages)):
                response["store"] = False

    if req.stream:
        return event_stream(_stream(shape, builder, sub.merged, keep))
    try:
        response = shape.whole(await whole(builder.collect(sub.merged)))
    except ClientGone:
        return Response(status_code=499)
    keep(response)
    return JSONResponse(response)


def _stream(shape: ResponseShape, builder: ResponseBuilder, merged, keep):
    return translated(ResponsesEvents(shape, on_final=keep), builder.chunks(merged, usage=True))


def get_response(state: ServerState, request: Request, response_id: str) -> dict:
    stored = state.responses.get(state.tenant(state.authenticate(request)), response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


def delete_response(state: ServerState, request: Request, response_id: str) -> dict:
    if not state.responses.delete(state.tenant(state.authenticate(request)), response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    # Another tenant's response is not found either: whether an id exists is not told across keys.
    return APIError(404, f"no stored response with id {response_id!r}", "NotFoundError", "response_id")


# -- preparation, on the worker threads ------------------------------------------------
def _prepare(state: ServerState, body: Any, key: str | None):
    req: ResponsesRequest = state.parse(ResponsesRequest, body)
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, TRUNCATION, param="truncation")
    state.refuse_unsupported(ResponsesRequest, body, REFUSED)   # server.unsupported's rule, as chat's
    try:
        history = _history(state, req, key)
        convo = history + input_messages(req.input)
        chat = chat_body(req, convo, req.function_tools())
        chat_req, params, prompts, tools = prepare_chat(state, chat)
    except FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    except APIError as e:
        raise renamed(e, CHAT_TO_RESPONSES) from None
    return req, convo, chat_req, params, prompts, tools


def _history(state: ServerState, req: ResponsesRequest, key: str | None) -> list[dict]:
    rid = req.previous_response_id
    if rid is None:
        return []
    if not state.responses.enabled:
        raise APIError(400, "previous_response_id: this server keeps no responses (--max-stored-responses 0); "
                            "send the whole conversation as input", param="previous_response_id")
    stored = state.responses.get(state.tenant(key), rid)
    if stored is None:
        raise APIError(400, f"previous_response_id: no stored response with id {rid!r} (made with store: false, "
                            "evicted, deleted, or never made)", param="previous_response_id")
    return [dict(m) for m in stored.messages]


def _tool_dicts(chat_req) -> list[dict]:
    return [t.function.model_dump(exclude_none=True) for t in chat_req.tools or []]
