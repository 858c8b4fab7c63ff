"""What the server reads of an engine (tokenizer, limits, validation), without its weights.

With data parallelism the engines live in replica processes, but the server still
tokenizes, validates and answers /tokenize in its own process, by the same rules.
"""
from __future__ import annotations

from typing import Sequence as Seq

from ..config import EngineConfig
from ..engine.validation import RequestRules
from ..kv import KVCacheManager
from ..loader import load_config, load_tokenizer, resolve_model_dir
from ..models import ModelConfig
from ..sampling_params import BeamSearchParams, SamplingParams
from .replica import ReplicaInfo


class EngineShape:
    """The parts of LLMEngine that ServerState, the token routes and the metrics read:
    cfg, model_cfg, tokenizer, model_name, max_model_len, kv, rules, validate. The
    request rules are the engine's own (RequestRules) over a real, empty KV manager the
    size of the smallest replica's pool, so "can this request ever fit" is asked of a
    pool of the same size and policy as the one it will run in."""

    def __init__(self, cfg: EngineConfig) -> None:
        """The tokenizer and model config (loaded while the replicas load their weights)."""
        self.cfg = cfg
        # The HF directories read (a GGUF's converted one): the server's /model_info names them.
        self.model_dir = model_dir = resolve_model_dir(cfg.model)
        self.tokenizer_dir = model_dir if cfg.tokenizer is None else resolve_model_dir(cfg.tokenizer)
        self.model_cfg = ModelConfig.from_hf(load_config(model_dir))
        self.tokenizer = load_tokenizer(self.tokenizer_dir)

    def fit(self, infos: list[ReplicaInfo]) -> None:
        """The limits, from the started replicas' engines."""
        info = infos[0]
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.kv = KVCacheManager(min(i.num_blocks for i in infos), info.block_size, info.enable_prefix_caching,
                                 self.cfg.allocation, self.max_model_len)
        self.rules = RequestRules(self.tokenizer, self.model_cfg.vocab_size, self.max_model_len,
                                  self.cfg.max_num_seqs, self.kv, info.chars_per_token)

    def validate(self, prompt: str | Seq[int], params: SamplingParams | BeamSearchParams,
                 add_special_tokens: bool = True) -> list[int]:
        return self.rules.validate(prompt, params, add_special_tokens)
