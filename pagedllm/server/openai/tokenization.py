"""vLLM's /tokenize and /detokenize: request shapes and the work (on a worker thread).

Shapes follow vLLM's: tokenize takes {"prompt"} (special tokens added by default, as for
a completion) or {"messages"} (the chat template's text, no second BOS), and answers
{"count", "max_model_len", "tokens", "token_strs"}; detokenize takes {"tokens"} and
answers {"prompt"}.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from .chat_template import render_chat
from .protocol import ChatMessage, conversation
from .tools import ChatTool, tool_dicts

if TYPE_CHECKING:
    from ...engine.client import EngineInfo


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template holds the special tokens it wants
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None   # what the template shows the model, as a chat request's
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]  # not "1", 1.5 or true


def tokenize(info: EngineInfo, tokenizer, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """ValueError (naming the field) for text that is empty, too long, or that the chat
    template rejects; a count above max_model_len is refused, as vLLM does."""
    if isinstance(req, TokenizeChatRequest):
        text = render_chat(tokenizer, conversation(req.messages), req.add_generation_prompt, tool_dicts(req.tools),
                           req.chat_template_kwargs)
    else:
        text = req.prompt
    limit = info.max_model_len
    # Bound the length before encoding: a 4 MB prompt is refused without tokenizing it.
    if len(text) > info.rules.chars_per_token * limit:
        raise ValueError(f"prompt is {len(text)} characters, more than max_model_len ({limit}) tokens can hold")
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens) if text else []
    if len(ids) > limit:
        raise ValueError(f"prompt is {len(ids)} tokens; max_model_len is {limit}")
    return {"count": len(ids), "max_model_len": limit, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize(info: EngineInfo, tokenizer, req: DetokenizeRequest) -> dict[str, Any]:
    vocab = info.vocab_size
    if len(req.tokens) > info.max_model_len:
        raise ValueError(f"tokens: {len(req.tokens)} ids; the limit is max_model_len ({info.max_model_len})")
    if any(not 0 <= t < vocab for t in req.tokens):
        raise ValueError(f"tokens: ids must be integers in [0, {vocab})")
    try:
        return {"prompt": tokenizer.decode(req.tokens)}
    except Exception as e:  # an id the model has but its tokenizer lacks (padded vocabularies)
        raise ValueError(f"tokens: the tokenizer cannot decode them ({e})") from None
