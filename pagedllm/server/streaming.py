"""Serving a prepared request: queue its prompts on the engine, then answer with one
OpenAI JSON response or a stream of SSE chunks, aborting everything if the client leaves."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.client import EngineDeadError, QueueFullError, RequestFailedError
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .http import ServerClosing, until, until_closing
from .state import APIError, ServerState

logger = logging.getLogger(__name__)


async def serve(state: ServerState, request: Request, req, prefix: str, prompts: list[list[int]], params,
                key: str | None, chat: bool, echo: list[str] | None = None):
    engine = state.engine
    if isinstance(params, SamplingParams):  # a stream writes what is new; a response needs only the end
        params.output_kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
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
    resp = ResponseBuilder(state, req, rid, chat, params.n, echo)
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


class ResponseBuilder:
    """Builds OpenAI responses and SSE chunks from engine outputs."""

    def __init__(self, state: ServerState, req, rid: str, chat: bool, n: int, echo: list[str] | None = None) -> None:
        self.state, self.req, self.rid, self.chat, self.n = state, req, rid, chat, n
        self.echo = echo  # per prompt: the text each of its choices starts with
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _index(self, prompt_idx: int, c: CompletionOutput) -> int:
        return prompt_idx * self.n + c.index

    def usage(self, finals: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        # A streamed request's last output holds its last tokens only: its metrics have the lengths.
        completion = sum(sum(o.metrics.get("output_lens") or [len(c.token_ids) for c in o.outputs])
                         for o in finals.values())
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
        """One chunk per new piece of each choice, as the engine's DELTA outputs give them:
        their text is already safe to send (no partial stop string, no broken character)."""
        opened: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        chunk_obj = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            async for i, out in until_closing(merged, self.state.closing):
                if out.finished:
                    finals[i] = out
                for c in out.outputs:
                    idx = self._index(i, c)
                    done = c.finish_reason is not None
                    if idx not in opened:
                        opened.add(idx)
                        if self.chat:  # OpenAI opens each choice with the assistant role
                            yield self._chunk(chunk_obj, idx, {"role": "assistant", "content": ""}, None, None)
                        elif self.echo:  # the prompt comes first, in a chunk of its own
                            yield self._chunk(chunk_obj, idx, self.echo[i], None, None)
                    if not c.text and not done and not c.logprobs:
                        continue
                    yield self._chunk(chunk_obj, idx, c.text, c.finish_reason if done else None, c.logprobs or None,
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
