"""Serving a prepared request: queue its prompts on the engine, then answer with one
OpenAI JSON response or a stream of SSE chunks, aborting everything if the client leaves."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.client import EngineDeadError, InvalidRequestError, QueueFullError, RequestFailedError
from ..engine.detokenizer import token_text
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .http import ServerClosing, until, until_closing
from .openai.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from .openai.tool_output import ChoiceCalls, ToolOutput
from .parsers.reasoning import REASONING_PARSERS, ThinkSplitter, split_all
from .state import APIError, ServerState

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Submitted:
    """A prepared request queued on the engine: its id, its outputs (merged over its prompts,
    as (prompt index, output); closing them aborts what is still running) and the served
    adapter's name, if it names one."""
    rid: str
    merged: AsyncIterator[tuple[int, RequestOutput]]
    lora_name: str | None


async def submit(state: ServerState, request: Request, req, prefix: str, prompts: list[list[int]], params,
                 key: str | None) -> Submitted:
    """Queue every prompt of a prepared request (chat's, completions', or another API's made
    into chat's) on the engine; APIError (503, 400) when it refuses one, the others aborted."""
    engine = state.engine
    if isinstance(params, SamplingParams):  # a stream writes what is new; a response needs only the end
        params.output_kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    salt = state.cache_salt(key, req.cache_salt)
    policy = engine.info.cfg.scheduling_policy
    if req.priority and policy != "priority":
        raise APIError(400, f"priority: {req.priority} needs the priority scheduling policy (the server runs "
                            f"--scheduling-policy {policy})", param="priority")
    rid = f"{prefix}-{uuid.uuid4().hex}"
    lora = state.loras.get(req.model)   # a served adapter's name picks it; anything else is the base
    streams = []
    if state.tracer is not None:
        for i in range(len(prompts)):
            state.tracer.begin(f"{rid}-{i}", request.headers, params)
    try:
        for i, ids in enumerate(prompts):
            streams.append(engine.submit(f"{rid}-{i}", ids, params, salt, owner=state.tenant(key),
                                         priority=req.priority, lora_request=lora))
    except (QueueFullError, EngineDeadError) as e:
        await _refused(state, rid, prompts, streams)
        raise APIError(503, str(e), "service_unavailable") from None
    except ValueError as e:
        await _refused(state, rid, prompts, streams)
        raise APIError(400, str(e)) from None
    # A client that leaves (before its first token, too: a long prefill sends nothing)
    # aborts its requests and frees their blocks before the next step.
    merged = until(_merge(streams), _wait_disconnect(request), ClientGone)
    return Submitted(rid, merged, lora.lora_name if lora else None)


async def whole(collect: Awaitable[T]) -> T:
    """A whole (not streamed) answer's collection, its failures as APIErrors (ClientGone
    passes: nobody is left to answer)."""
    try:
        return await collect
    except InvalidRequestError as e:  # its own parameters could not all be met
        raise APIError(400, str(e)) from None
    except RequestFailedError as e:
        raise APIError(500, str(e), "internal_error") from None
    except EngineDeadError as e:
        raise APIError(503, str(e), "service_unavailable") from None
    except ValueError as e:  # any other refusal of the engine loop's add names what is wrong
        raise APIError(400, str(e)) from None


async def serve(state: ServerState, request: Request, req, prefix: str, prompts: list[list[int]], params,
                key: str | None, chat: bool, echo: list[str] | None = None, tools: ToolOutput | None = None):
    sub = await submit(state, request, req, prefix, prompts, params, key)
    resp = ResponseBuilder(state, req, sub.rid, chat, params.n, echo, tools, sub.lora_name)
    if req.stream:
        return event_stream(resp.sse(sub.merged))
    try:
        # Plain JSON types already: a JSONResponse spares FastAPI's jsonable_encoder walking a
        # response of thousands of prompt-logprob entries (on the event loop, under the GIL).
        return JSONResponse(await whole(resp.collect(sub.merged)))
    except ClientGone:
        return Response(status_code=499)


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _refused(state: ServerState, rid: str, prompts: list, streams: list) -> None:
    """The engine refused one prompt of a request: abort those it took (their ends are traced
    as any abort), and forget the traces of those it never saw."""
    for s in streams:
        await s.aclose()
    if state.tracer is not None:
        for i in range(len(streams), len(prompts)):
            state.tracer.forget(f"{rid}-{i}")


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

    def __init__(self, state: ServerState, req, rid: str, chat: bool, n: int, echo: list[str] | None = None,
                 tools: ToolOutput | None = None, model: str | None = None) -> None:
        self.state, self.req, self.rid, self.chat, self.n = state, req, rid, chat, n
        self.model = model or state.model_name   # the served name answered: an adapter's own, else the base's
        self.echo = echo  # per prompt: the text each of its choices starts with
        self.tools = tools  # chat: how a choice's text becomes tool calls (None: it is the content)
        # max_tokens 0 with echo: the engine ran one token, which no part of the answer shows.
        self.prompt_only = not chat and req.prompt_only
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.text_of = functools.partial(token_text, state.tokenizer)
        # chat: how a choice's text splits into reasoning and answer (--reasoning-parser)
        self.reasoning = REASONING_PARSERS[state.reasoning_parser] if chat and state.reasoning_parser else None

    def _index(self, prompt_idx: int, c: CompletionOutput) -> int:
        return prompt_idx * self.n + c.index

    def usage(self, finals: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        # A streamed request's last output holds its last tokens only: its metrics have the lengths.
        completion = 0 if self.prompt_only else sum(
            sum(o.metrics.get("output_lens") or [len(c.token_ids) for c in o.outputs]) for o in finals.values())
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
                ch = self._message(c) if self.chat else self._completion_choice(finals[i], i, c)
                choices.append({"index": self._index(i, c), **ch})
        choices.sort(key=lambda ch: ch["index"])
        resp = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(finals)}
        if self.chat and self.req.prompt_logprobs is not None and finals:  # vLLM's place: the response's
            resp["prompt_logprobs"] = vllm_prompt_logprobs(finals[0].prompt_logprobs, self.req.prompt_logprobs)
        return resp

    def _message(self, c: CompletionOutput) -> dict:
        lps = chat_logprobs(c.logprobs, self.req.top_logprobs or 0) if c.logprobs is not None else None
        text, reasoning = c.text, None
        if self.reasoning is not None:
            reasoning, text = split_all(self.reasoning(), text)
        message, finish = {"role": "assistant", "content": text}, c.finish_reason
        if self.tools is not None:
            message, finish = self.tools.message(text, finish)
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        return {"finish_reason": finish, "stop_reason": c.stop_reason, "message": message, "logprobs": lps}

    def _completion_choice(self, out: RequestOutput, i: int, c: CompletionOutput) -> dict:
        echo = self.echo[i] if self.echo else ""
        ch: dict[str, Any] = {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.prompt_only:
            ch.update(finish_reason="length", stop_reason=None, text=echo)
        else:
            ch["text"] = echo + c.text
        ch["logprobs"] = None
        if self.req.logprobs is not None:
            # The echoed prompt's tokens first (vLLM's order), then the output's from where its text starts.
            lps = self._echo_logprobs(out.prompt_token_ids, out.prompt_logprobs) if self.echo else None
            if not self.prompt_only:
                lps = _joined(lps, self._output_logprobs(c.logprobs, len(echo)))
            ch["logprobs"] = lps
        if self.req.prompt_logprobs is not None:
            ch["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, self.req.prompt_logprobs)
        return ch

    def _echo_logprobs(self, ids: list[int], entries: list | None) -> dict:
        if entries is None or len(entries) != len(ids):  # the engine scores every prompt token before the first
            raise RuntimeError(f"prompt logprobs for {len(entries or [])} of {len(ids)} prompt tokens")
        return completion_logprobs(entries, self.req.logprobs, 0, ids, self.text_of)

    def _output_logprobs(self, entries: list | None, offset: int) -> dict:
        return completion_logprobs(entries or [], self.req.logprobs, offset)

    async def sse(self, merged) -> AsyncIterator[str]:
        """Chat's or completions' stream: `chunks` as SSE data lines, then [DONE]; an error
        after the headers went out travels as an error event."""
        opts = self.req.stream_options
        try:
            async for chunk in self.chunks(merged, usage=opts is not None and opts.include_usage):
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        except ServerClosing as e:  # the shutdown grace is over: end cleanly, the requests aborted
            yield _sse({"error": {"message": str(e), "type": "service_unavailable", "param": None, "code": 503}})
            yield "data: [DONE]\n\n"
        except ClientGone:  # nobody to tell; its requests are aborted
            return
        except Exception as e:  # after the headers went out, errors travel in the stream
            logger.warning("stream %s failed: %s", self.rid, e)
            kind, code = ("invalid_request_error", 400) if isinstance(e, InvalidRequestError) else ("internal_error", 500)
            yield _sse({"error": {"message": str(e), "type": kind, "param": None, "code": code}})
            yield "data: [DONE]\n\n"

    async def chunks(self, merged, usage: bool = False) -> AsyncIterator[dict]:
        """One chunk per new piece of each choice, as the engine's DELTA outputs give them:
        their text is already safe to send (no partial stop string, no broken character).
        usage: a last chunk with no choices and the usage. Failures are raised: each API
        tells its client in its own stream's terms (ServerClosing, ClientGone, others)."""
        opened: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        prompt_lps: dict[int, list] = {}  # per prompt: its logprob entries, which arrive in pieces
        offsets: dict[int, int] = {}      # per choice: where its next token's text starts
        calls: dict[int, ChoiceCalls] = {}  # per choice: its text read for tool calls
        thinking: dict[int, ThinkSplitter] = {}  # per choice: its text split into reasoning and answer
        chunk_obj = "chat.completion.chunk" if self.chat else "text_completion"
        async for i, out in until_closing(merged, self.state.closing):
            if out.finished:
                finals[i] = out
            if out.prompt_logprobs:
                prompt_lps.setdefault(i, []).extend(out.prompt_logprobs)
            for c in out.outputs:
                idx = self._index(i, c)
                done = c.finish_reason is not None
                if idx not in opened:
                    opened.add(idx)
                    if self.chat:  # OpenAI opens each choice with the assistant role
                        yield self._chunk(chunk_obj, idx, {"role": "assistant", "content": ""}, None, None)
                    elif self.echo:  # the prompt comes first, in a chunk of its own
                        yield self._echo_chunk(chunk_obj, idx, i, out, prompt_lps.get(i))
                        offsets[idx] = len(self.echo[i])
                if self.prompt_only:  # the token run for it is nobody's answer
                    if done:
                        yield self._chunk(chunk_obj, idx, "", "length", None)
                    continue
                delta, finish, think = c.text, c.finish_reason, ""
                if self.reasoning is not None:
                    think, delta = self._reasoning_delta(thinking, idx, c.text, done)
                if self.tools is not None:
                    delta, finish = self._tool_delta(calls, idx, delta, finish)
                if think:
                    delta = {**(delta if isinstance(delta, dict) else {"content": delta} if delta else {}),
                             "reasoning_content": think}
                if not delta and not done and not c.logprobs:
                    continue
                yield self._chunk(chunk_obj, idx, delta, finish, self._delta_logprobs(c, idx, offsets),
                                  c.stop_reason if done else None)
        if usage:
            yield {"id": self.rid, "object": chunk_obj, "created": self.created, "model": self.model,
                   "choices": [], "usage": self.usage(finals)}

    def _reasoning_delta(self, thinking: dict[int, ThinkSplitter], idx: int, text: str,
                         done: bool) -> tuple[str, str]:
        """A choice's new (reasoning, answer) text; its last piece flushes what was held."""
        if idx not in thinking:
            thinking[idx] = self.reasoning()
        think, answer = thinking[idx].feed(text)
        if done:
            more, rest = thinking[idx].end()
            think, answer = think + more, answer + rest
        return think, answer

    def _tool_delta(self, calls: dict[int, ChoiceCalls], idx: int, text: str,
                    finish: str | None) -> tuple[dict, str | None]:
        """A chat delta of content and tool_calls; the choice's last one flushes its reader."""
        tools = self.tools
        assert tools is not None
        if idx not in calls:
            calls[idx] = tools.stream()
        reader = calls[idx]
        content, deltas = reader.feed(text)
        if finish is not None:
            rest, more = reader.end()
            content, deltas = content + rest, deltas + more
            finish = tools.finish_reason(reader.calls, finish)
        delta: dict[str, Any] = {"content": content} if content else {}
        if deltas:
            delta["tool_calls"] = deltas
        return delta, finish

    def _delta_logprobs(self, c: CompletionOutput, idx: int, offsets: dict[int, int]) -> dict | None:
        """A chunk's logprobs; a completion's offsets go on from where the choice's text is."""
        if not c.logprobs:
            return None
        if self.chat:
            return chat_logprobs(c.logprobs, self.req.top_logprobs or 0)
        lps = self._output_logprobs(c.logprobs, offsets.get(idx, 0))
        offsets[idx] = offsets.get(idx, 0) + sum(map(len, lps["tokens"]))
        return lps

    def _echo_chunk(self, obj: str, idx: int, i: int, out: RequestOutput, entries: list | None) -> dict:
        lps = self._echo_logprobs(out.prompt_token_ids, entries) if self.req.logprobs is not None else None
        return self._chunk(obj, idx, self.echo[i], None, lps)

    def _chunk(self, obj: str, idx: int, delta, finish, lps: dict | None, stop_reason=None) -> dict:
        """lps: the logprobs object already in the endpoint's shape."""
        choice: dict[str, Any] = {"index": idx, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
        else:
            choice["text"] = delta
        choice["logprobs"] = lps
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}


def _joined(a: dict | None, b: dict) -> dict:
    """Two completion logprobs objects, b's tokens after a's."""
    return b if a is None else {key: a[key] + b[key] for key in a}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
