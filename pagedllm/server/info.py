"""/model_info and /server_info: what a gateway learns of a worker, in SGLang's field names.

The SGLang Model Gateway (PyPI sglang-router) asks each worker it is given for these two
when it registers it: a served name from /server_info (`served_model_name`, else
`model_path`) becomes the model's id in the gateway's /v1/models, `model_type` and
`architectures` from /model_info go on its model card, and it loads a tokenizer from
/server_info's `model_path` for its own tokenizing routes. Without them it names the model
`unknown`.

Only facts of this server, under SGLang's names where the two overlap (SGLang's page is our
block, its context length our max_model_len); nothing about keys or tenants.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import __version__
from ..engine.client import EngineInfo
from ..loader import load_config
from ..models.registry import FAMILIES


def _paths(info: EngineInfo) -> dict[str, str]:
    """SGLang's model_path and tokenizer_path are HF directories (or hub ids); ours are the
    directories the weights and tokenizer were read from (for a GGUF, the one it was
    converted to), so a gateway on the same machine loads our tokenizer."""
    return {"model_path": str(info.model_dir), "tokenizer_path": str(info.tokenizer_dir)}


@lru_cache(maxsize=4)
def _architectures(model_dir: Path, model_type: str) -> list[str]:
    """config.json's, read once (a client polling /model_info reads no file)."""
    fam = FAMILIES.get(model_type)  # a config.json without them (a GGUF's converted one): the family's class
    return load_config(model_dir).get("architectures") or ([fam.architecture] if fam else [])


def model_info(info: EngineInfo) -> dict[str, Any]:
    """SGLang's /model_info."""
    model_type = info.model_type
    return {
        **_paths(info),
        "is_generation": True,
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": list(_architectures(info.model_dir, model_type)),
    }


def server_info(info: EngineInfo, served_name: str, kv_blocks: int) -> dict[str, Any]:
    """SGLang's /server_info, the fields it shares with our configuration. kv_blocks is
    the KV pool's block count, summed over data-parallel replicas; max_running_requests
    and max_total_num_tokens are the server's totals, as SGLang's are over its DP ranks."""
    cfg = info.cfg
    return {
        **_paths(info),
        "served_model_name": served_name,
        "version": __version__,
        "tp_size": cfg.tensor_parallel_size,
        "dp_size": cfg.data_parallel_size,
        "context_length": info.max_model_len,
        "page_size": cfg.block_size,
        "max_running_requests": cfg.max_num_seqs * cfg.data_parallel_size,
        "max_prefill_tokens": cfg.max_num_batched_tokens,
        "max_total_num_tokens": kv_blocks * cfg.block_size,
        "disable_radix_cache": not cfg.enable_prefix_caching,
    }
