"""POST /v1/responses (OpenAI's Responses API), with GET and DELETE of a stored response.

A request is made into a chat completion request (request.py), prepared, checked
and queued exactly as one (prepare.py, translation.py), and its chat answer, whole or
streamed, made into the Responses shapes (output.py). With `store` (the default,
as OpenAI's) the conversation is kept for `previous_response_id`, per tenant
(store.py)."""
from __future__ import annotations

from typing import Any

from fastapi import Request

from ..prepare import PreparedChat, prepare_chat
from ..state import APIError, ServerState
from ..translation import answer, named_as, queue_as_chat
from .output import ResponsesEvents, ResponseShape, assistant_messages, new_id
from .request import CHAT_TO_RESPONSES, REFUSED, TRUNCATION, ResponsesRequest, chat_body, input_messages
from .store import StoredResponse


async def create_response(state: ServerState, request: Request):
    key = state.authenticate(request)
    body = await state.read_json(request)
    req, convo, chat = await state.off_loop(_prepare, state, body, key)
    call = await queue_as_chat(state, request, key, chat, "resp", CHAT_TO_RESPONSES)
    shape = ResponseShape(req, new_id("resp"), call.builder.model, [dict(t, type="function") for t in
                                                                      _tool_dicts(chat.req)])
    tenant = state.tenant(key)

    def keep(response: dict) -> None:
        """Stores the response (before it goes out: a refused store says store: false in it)."""
        if req.store:
            messages = convo + assistant_messages(response["output"])
            if not state.responses.put(tenant, response["id"], StoredResponse.of(response, messages)):
                response["store"] = False

    return await answer(call, req.stream, shape, ResponsesEvents(shape, on_final=keep), on_whole=keep)


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
def _prepare(state: ServerState, body: Any, key: str | None) -> tuple[ResponsesRequest, list[dict], PreparedChat]:
    req: ResponsesRequest = state.parse(ResponsesRequest, body)
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, TRUNCATION, param="truncation")
    state.refuse_unsupported(ResponsesRequest, body, REFUSED)   # server.unsupported's rule, as chat's
    with named_as(CHAT_TO_RESPONSES):
        convo = _history(state, req, key) + input_messages(req.input)
        chat = prepare_chat(state, chat_body(req, convo, req.function_tools()))
    return req, convo, chat


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
