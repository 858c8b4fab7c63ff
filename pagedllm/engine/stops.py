"""When a sequence stops: its token ids (EOS, stop_token_ids) and its lengths (max_tokens, the
context's max_model_len), in vLLM's order. Stop strings need text: the output processor
finds them and says where (a StopAt), and StepApplier applies that."""
from __future__ import annotations

from .sequence import Request, Sequence


class StopRules:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def tokens_left(self, req: Request, num_output_tokens: int) -> int:
        """The one length rule: output tokens a request may still add, under its max_tokens
        and the context's max_model_len."""
        return min(req.max_tokens - num_output_tokens, self.max_model_len - len(req.prompt_token_ids) - num_output_tokens)

    def at_length_limit(self, req: Request, num_output_tokens: int) -> bool:
        return self.tokens_left(req, num_output_tokens) <= 0

    def after(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """(finish reason, stop reason) if the token just appended ends the sequence. Nothing
        but the length limits ends an output before min_tokens."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
                return "stop", token
        if self.at_length_limit(seq.request, seq.num_output_tokens):
            return "length", None
        return None
