"""The offline API, vLLM-compatible: LLM(...).generate(prompts, sampling_params)."""
from __future__ import annotations

import logging
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from ..config import EngineConfig
from ..lora.request import LoRARequest
from ..outputs import BeamSearchOutput, BeamSearchSequence, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from ..pooling import pooled
from ..sampling_params import BeamSearchParams, SamplingParams
from .engine import LLMEngine
from .stats import EngineStats

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """The offline API over an engine built elsewhere (its own runner, a fake one)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None,
                 priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Text prompts get the tokenizer's special tokens (BOS), as vLLM's; a prompt dict
        may carry its own cache_salt, which wins over the argument. `priority` (vLLM's): one
        per prompt, lower first, under scheduling_policy="priority". `lora_request` (vLLM's;
        enable_lora): one adapter for every prompt, or one per prompt (None: the base model)."""
        return self._generate(prompts, sampling_params, use_tqdm, cache_salt, add_special_tokens=True,
                              priority=priority, lora_request=lora_request)

    def _generate(self, prompts: Prompt | Seq[Prompt], sampling_params, use_tqdm: bool,
                  cache_salt: str | None, add_special_tokens: bool,
                  priority: Seq[int] | None = None, lora_request=None) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        # Validate the whole batch before queueing any of it: a bad prompt fails fast
        # and leaves nothing half-submitted in the engine.
        values = []
        grammars: set[int] = set()
        read: set[LoRARequest] = set()
        for i, lora in enumerate(loras):   # read (and kept) before anything runs, as grammars are compiled
            if lora is not None and lora not in read:
                read.add(lora)
                try:
                    self.engine.adapters.check(lora)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                self.engine.check_priority(priority[i])
                value, salt = _prompt_value(p), _prompt_salt(p, cache_salt)
                token_ids = self.engine.validate(value, sp, add_special_tokens)
                so = getattr(sp, "structured_outputs", None)  # BeamSearchParams has none
                if so is not None and id(so) not in grammars:  # compiled (cached) before anything runs
                    self.engine.check_grammar(so)
                    grammars.add(id(so))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            values.append((value, salt, token_ids))
        ids: list[str] = []
        try:
            for (value, salt, token_ids), sp, prio, lora in zip(values, params, priority, loras):
                ids.append(self.engine.add_request(None, value, sp, salt, add_special_tokens=add_special_tokens,
                                                   prompt_token_ids=token_ids, priority=prio,
                                                   lora_request=lora).request_id)
        except ValueError as e:  # an adapter that cannot be loaded: nothing of the batch stays queued
            for rid in ids:
                self.engine.abort_request(rid)
            raise ValueError(f"prompt {len(ids)}: {e}") from None
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Seq[Prompt], use_tqdm: bool = True, normalize: bool = True,
              cache_salt: str | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed for a decoder: each prompt's last-token pooling (its last hidden
        state after the final norm), L2-normalized unless normalize=False. The prompt is
        prefilled as any other (a cached prefix is not computed again); its one sampled
        token is dropped. Sensible for embedding models with last-token pooling (Qwen3-Embedding,
        gte-Qwen2, e5-mistral); a chat model's vectors are its last state, not trained to embed."""
        params = SamplingParams(max_tokens=1, temperature=0, embed=True)
        outs = self._generate(prompts, params, use_tqdm, cache_salt, add_special_tokens=True)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(
            pooled(o.embedding, normalize)), o.num_cached_tokens) for o in outs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in conversations]
        # The template already holds the special tokens it wants: no second BOS.
        return self._generate(prompts, sampling_params, use_tqdm, None, add_special_tokens=False)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        if not conversation:
            raise ValueError("messages must not be empty")
        for m in conversation:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs a role (system, user, assistant, tool) and string content; got {m!r}")
        return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kw)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in wanted - results.keys():
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search, run inside the engine: each prompt's beams share blocks,
        fork and copy on write; the kept beams come back best first (HF's scores)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _as_list(prompts)
        outs = self._generate(prompts, [params] * len(prompts), use_tqdm, None, add_special_tokens=True)
        return [BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.cumulative_logprob, c.text,
                                                     c.finish_reason, c.stop_reason, score)
                                  for c, score in zip(o.outputs, o.metrics["beam_scores"])]) for o in outs]

    def close(self) -> None:
        """Stop the tensor-parallel worker processes now (they also stop when this LLM is
        collected or the process exits). Nothing to do without tensor parallelism."""
        self.engine.close()

    def get_stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()


def _as_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def _prompt_salt(p: Prompt, default: str | None) -> str | None:
    if not isinstance(p, dict) or p.get("cache_salt") is None:
        return default
    salt = p["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def _prompt_value(p: Prompt) -> str | list[int]:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return p["prompt_token_ids"]
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(p, (str, list)):
        return p
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")
