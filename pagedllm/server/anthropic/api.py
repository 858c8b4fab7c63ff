"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

As /v1/responses does, a request becomes a chat completion request (request.py)
and its chat answer becomes Anthropic's shapes (output.py). Errors, those of the
shared steps too, are answered in Anthropic's error shape, which its clients read."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..openai.structured import FieldError
from ..prepare import check_structured, prepare_chat, renamed
from ..state import APIError, ServerState
from ..streaming import ClientGone, ResponseBuilder, event_stream, submit, translated, whole
from .output import MessageEvents, MessageShape, error_response, new_id
from .request import CHAT_TO_MESSAGES, REFUSED, MessagesRequest, chat_body

logger = logging.getLogger(__name__)


async def create_message(state: ServerState, request: Request):
    return await _answered("/v1/messages", lambda: _create(state, request))


async def count_tokens(state: ServerState, request: Request):
    async def count():
        state.authenticate(request)
        body = await state.read_json(request)
        body = {**body, "max_tokens": 1} if isinstance(body, dict) else body   # not a field of this request
        _, _, _, prompts, _ = await state.off_loop(_prepare, state, body)
        return JSONResponse({"input_tokens": len(prompts[0])})
    return await _answered("/v1/messages/count_tokens", count)


async def _answered(route: str, call):
    """call()'s response, its errors in Anthropic's shape: a refusal's status and message, and a
    bug of ours as a 500 its clients still read."""
    try:
        return await call()
    except APIError as e:
        return error_response(e.status, e.message)
    except Exception:
        logger.exception("%s failed", route)
        return error_response(500, "internal error")


async def _create(state: ServerState, request: Request):
    key = state.authenticate(request)
    body = await state.read_json(request)
    req, chat_req, params, prompts, tools = await state.off_loop(_prepare, state, body)
    try:
        await check_structured(state, chat_req, params, key)
    except APIError as e:
        raise renamed(e, CHAT_TO_MESSAGES) from None
    sub = await submit(state, request, chat_req, "msg", prompts, params, key)
    builder = ResponseBuilder(state, chat_req, sub.rid, True, 1, None, tools, sub.lora_name)
    shape = MessageShape(new_id(), builder.model, len(prompts[0]))
    if req.stream:
        return event_stream(_stream(shape, builder, sub.merged))
    try:
        return JSONResponse(shape.whole(await whole(builder.collect(sub.merged))))
    except ClientGone:
        return Response(status_code=499)


def _stream(shape: MessageShape, builder: ResponseBuilder, merged):
    return translated(MessageEvents(shape), builder.chunks(merged, usage=True))


def _prepare(state: ServerState, body: Any):
    req: MessagesRequest = state.parse(MessagesRequest, body)
    state.refuse_unsupported(MessagesRequest, body, REFUSED)   # server.unsupported's rule, as chat's
    try:
        chat = chat_body(req, req.custom_tools())
        chat_req, params, prompts, tools = prepare_chat(state, chat)
    except FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    except APIError as e:
        raise renamed(e, CHAT_TO_MESSAGES) from None
    return req, chat_req, params, prompts, tools
