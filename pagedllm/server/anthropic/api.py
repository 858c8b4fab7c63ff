"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

As /v1/responses does, a request becomes a chat completion request (request.py)
and its chat answer becomes Anthropic's shapes (output.py). Errors, those of the
shared steps too, are answered in Anthropic's error shape, which its clients read."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ..prepare import PreparedChat, prepare_chat
from ..state import APIError, ServerState
from ..translation import answer, named_as, queue_as_chat
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
        _, chat = await state.off_loop(_prepare, state, body)
        return JSONResponse({"input_tokens": len(chat.prompts[0])})
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
    req, chat = await state.off_loop(_prepare, state, body)
    call = await queue_as_chat(state, request, key, chat, "msg", CHAT_TO_MESSAGES)
    shape = MessageShape(new_id(), call.builder.model, len(chat.prompts[0]))
    return await answer(call, req.stream, shape, MessageEvents(shape))


def _prepare(state: ServerState, body: Any) -> tuple[MessagesRequest, PreparedChat]:
    req: MessagesRequest = state.parse(MessagesRequest, body)
    state.refuse_unsupported(MessagesRequest, body, REFUSED)   # server.unsupported's rule, as chat's
    with named_as(CHAT_TO_MESSAGES):
        chat = prepare_chat(state, chat_body(req, req.custom_tools()))
    return req, chat
