"""Request preparation, on the worker threads (never on the event loop): a parsed body made
into the engine's SamplingParams and token ids, every limit checked, and a constrained
request's grammar compiled before it is queued. Completions and chat here; the Responses and
Messages APIs become chat requests first (responses/api.py, anthropic/api.py)."""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

from ..engine.client import EngineDeadError
from ..sampling_params import BeamSearchParams, SamplingParams
from .openai.chat_template import render_chat
from .openai.protocol import ChatCompletionRequest, CompletionRequest
from .openai.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize, tokenize
from .openai.tool_output import ToolOutput
from .openai.tools import tool_dicts
from .parsers.reasoning import REASONING_PARSERS
from .parsers.tool_calls import TOOL_PARSERS
from .state import APIError, ServerState
from .unsupported import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED


def prepare_completion(state: ServerState, body: Any):
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


class PreparedChat(NamedTuple):
    """A chat request ready to queue: the request, the engine's params, its one prompt's token
    ids, and how the answer's text becomes tool calls (None: plain text)."""
    req: ChatCompletionRequest
    params: SamplingParams | BeamSearchParams
    prompts: list[list[int]]
    tools: ToolOutput | None


def prepare_chat(state: ServerState, body: Any) -> PreparedChat:
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
    if state.reasoning_parser is not None and isinstance(params, SamplingParams):
        _after_thinking(state, params, prompt)
    return PreparedChat(req, params, _token_ids(state, [prompt], params, chat=True), tools)


def _after_thinking(state: ServerState, params: SamplingParams, prompt: str) -> None:
    """A reasoning model's thinking stays in the text (its parser's tags may be special tokens), and
    a structured output's grammar starts after it (at the parser's answer_start), as vLLM's does:
    unless the prompt already closed the reasoning (the parser's closed_by)."""
    parser = REASONING_PARSERS[state.reasoning_parser]()
    if set(parser.tags) & set(state.tokenizer.all_special_tokens):
        params.skip_special_tokens = False
    if params.structured_outputs is not None and not parser.closed_by(prompt):
        params.structured_outputs.reasoning_end = state.tokenizer.encode(parser.answer_start, add_special_tokens=False)


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
    return ToolOutput("auto", parser=functools.partial(TOOL_PARSERS[state.tool_call_parser], tools=tool_dicts(req.tools)),
                      parallel=parallel)


async def check_structured(state: ServerState, req, params, key: str | None) -> None:
    """A constrained request's grammar is compiled (or found cached) before it is queued: a
    bad schema, regex or grammar is a 400, streaming or not, and never reaches a step."""
    if not isinstance(params, SamplingParams) or params.structured_outputs is None:
        return
    try:
        await state.engine.check_structured(params.structured_outputs, state.tenant(key))
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


def tokenize_body(state: ServerState, body: Any) -> dict:
    chat = isinstance(body, dict) and "messages" in body  # vLLM's two shapes, told apart as it does
    req = state.parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    try:
        return tokenize(state.engine.info, state.tokenizer, req)
    except ValueError as e:
        raise _bad(e, "messages" if chat else "prompt") from None


def detokenize_body(state: ServerState, body: Any) -> dict:
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
