"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): its request shapes,
the chat request each becomes, and the Message objects, events and errors in Anthropic's
shapes made from the chat answer."""
