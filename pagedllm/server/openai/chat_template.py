"""A chat request's prompt: its messages, tools and chat_template_kwargs through the
tokenizer's chat template (the same for /v1/chat/completions and /tokenize)."""
from __future__ import annotations

from typing import Any

from .structured import FieldError

# Arguments of apply_chat_template that the server sets: a kwarg of these names would change
# what the call returns (token ids, a dict, another template), not what the template reads.
RESERVED = frozenset({"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "chat_template",
                      "continue_final_message", "return_dict", "return_tensors", "return_assistant_tokens_mask",
                      "tokenizer_kwargs", "padding", "truncation", "max_length"})


def render_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None, kwargs: dict[str, Any] | None = None) -> str:
    """The template's text; FieldError naming messages or chat_template_kwargs."""
    clash = sorted(RESERVED & set(kwargs or {}))
    if clash:
        raise FieldError("chat_template_kwargs", f"{', '.join(clash)} set by the server, not by the template's "
                                                 "variables; leave them out")
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    except ValueError as e:
        raise FieldError("messages", str(e)) from None
    except Exception as e:  # a template that rejects this conversation (e.g. role order)
        raise FieldError("messages", f"the chat template rejected them: {e}") from None
