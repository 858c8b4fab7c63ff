"""Another API served as chat completions. The Responses (responses/) and Messages
(anthropic/) routes make each request a chat completion request, prepare, check and queue it
exactly as one, and make chat's answer, whole or streamed, into their own shapes. The steps
they share are written here once, so that the two cannot drift apart: chat's errors named in
the caller's fields, the queueing, the answer, and the reading of chat's stream."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.client import InvalidRequestError
from .http import ServerClosing
from .openai.structured import FieldError
from .prepare import PreparedChat, check_structured
from .state import APIError, ServerState
from .streaming import ClientGone, ResponseBuilder, Submitted, event_stream, submit, whole

logger = logging.getLogger(__name__)


class Events(Protocol):
    """Another API's stream, made from chat's chunk dicts."""

    def start(self) -> list[str]: ...

    def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]: ...

    def failed(self, status: int, message: str) -> str: ...


class Shape(Protocol):
    """Another API's whole answer, made from chat's whole response."""

    def whole(self, chat: dict) -> dict: ...


# -- the request side ----------------------------------------------------------------------
def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """A chat preparation's error for a request made into chat from another API's (Responses,
    Messages), naming that API's field: `names` maps chat's top-level fields to its own. A
    message's index is chat's, not the caller's, so an error inside one names the whole list."""
    if e.param is None:
        return e
    head, _, rest = e.param.partition(".")
    name = names.get(head, head)
    param = name if head == "messages" or not rest else f"{name}.{rest}"
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, e.type, param)


@contextmanager
def named_as(names: dict[str, str]) -> Iterator[None]:
    """Errors of chat's steps within, told in the caller's API: a bad field of the request made
    into chat (FieldError) is a 400, and an APIError names that API's field (see renamed)."""
    try:
        yield
    except FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    except APIError as e:
        raise renamed(e, names) from None


@dataclass(frozen=True, slots=True)
class ChatCall:
    """A request made into chat's, prepared and queued: its outputs on the engine and the
    builder that makes chat's answer of them."""
    sub: Submitted
    builder: ResponseBuilder


async def queue_as_chat(state: ServerState, request: Request, key: str | None, chat: PreparedChat, prefix: str,
                        names: dict[str, str]) -> ChatCall:
    """Checks the constraint (its grammar compiled before queueing, as chat's) and queues the
    prompt; errors name the caller's fields."""
    with named_as(names):
        await check_structured(state, chat.req, chat.params, key)
    sub = await submit(state, request, chat.req, prefix, chat.prompts, chat.params, key)
    # One choice, as chat's chunks (not SSE text) for the other API's events to read; no echo.
    builder = ResponseBuilder(state, chat.req, sub.rid, True, 1, None, chat.tools, sub.lora_name)
    return ChatCall(sub, builder)


# -- the response side ---------------------------------------------------------------------
async def answer(call: ChatCall, stream: bool, shape: Shape, events: Events,
                 on_whole: Callable[[dict], None] | None = None) -> Response:
    """chat's answer in the other API's shapes: its stream of `events`, or its whole object,
    which on_whole(obj) sees (and may change) before it goes out."""
    if stream:
        return event_stream(translated(events, call.builder.chunks(call.sub.merged, usage=True)))
    try:
        obj = shape.whole(await whole(call.builder.collect(call.sub.merged)))
    except ClientGone:
        return Response(status_code=499)
    if on_whole is not None:
        on_whole(obj)
    return JSONResponse(obj)


async def translated(events: Events, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Another API's stream (Responses, Messages) made from chat's chunks by `events` (its
    start(), events(chunks) and failed(status, message)): a failure after the headers went out
    ends it with that API's error event; a client gone ends it silently."""
    for e in events.start():
        yield e
    try:
        async for e in events.events(chunks):
            yield e
    except ServerClosing as e:
        yield events.failed(503, str(e))
        return
    except ClientGone:
        return
    except Exception as e:  # after the headers went out, errors travel in the stream
        logger.warning("stream failed: %s", e)
        yield events.failed(400 if isinstance(e, InvalidRequestError) else 500, str(e))


@dataclass(slots=True)
class ChatEnd:
    """How a chat stream ended, known once it has: the last finish_reason, the stop string (or
    token) that ended it, and the usage of its last chunk."""
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict | None = None


async def chat_deltas(chunks: AsyncIterator[dict], end: ChatEnd) -> AsyncIterator[dict]:
    """The deltas of a one-choice chat stream's chunk dicts, in order; what the stream says of
    its end (the usage-only last chunk, each finish_reason) goes into `end` instead."""
    async for chunk in chunks:
        if chunk.get("usage") is not None and not chunk["choices"]:
            end.usage = chunk["usage"]
            continue
        choice = chunk["choices"][0]
        if choice.get("finish_reason"):
            end.finish_reason, end.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        yield choice.get("delta") or {}
