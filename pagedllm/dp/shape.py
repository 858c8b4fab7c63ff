"""What the server reads of an engine (tokenizer, limits, validation), without its weights.

With data parallelism the engines live in replica processes, but the server still
tokenizes, validates and answers /tokenize in its own process, by the same rules.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..engine.engine import LLMEngine
from ..kv import KVCacheManager
from ..loader import load_config, load_tokenizer, resolve_model_dir
from ..models import ModelConfig
from .replica import ReplicaInfo


class EngineShape:
    """The parts of LLMEngine that ServerState, the token routes and the metrics read.

    Validation is LLMEngine's own code, borrowed method by method (not copied): it reads
    only cfg, tokenizer, model_cfg, max_model_len, _chars_per_token and kv (policy,
    can_ever_fit, pool size), which this class provides. `kv` is a real, empty KV manager
    the size of the smallest replica's pool, so "can this request ever fit" is asked of a
    pool of the same size and policy as the one it will run in."""

    validate = LLMEngine.validate
    _split_params = LLMEngine._split_params
    _tokenize = LLMEngine._tokenize
    _check_prompt_len = LLMEngine._check_prompt_len
    _check_lengths = LLMEngine._check_lengths

    def __init__(self, cfg: EngineConfig) -> None:
        """The tokenizer and model config (loaded while the replicas load their weights)."""
        model_dir = resolve_model_dir(cfg.model)
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_hf(load_config(model_dir))
        self.tokenizer = load_tokenizer(model_dir if cfg.tokenizer is None else resolve_model_dir(cfg.tokenizer))

    def fit(self, infos: list[ReplicaInfo]) -> None:
        """The limits, from the started replicas' engines."""
        info = infos[0]
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self._chars_per_token = info.chars_per_token
        self.kv = KVCacheManager(min(i.num_blocks for i in infos), info.block_size, info.enable_prefix_caching,
                                 self.cfg.allocation, self.max_model_len)
