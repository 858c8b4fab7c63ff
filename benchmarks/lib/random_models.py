"""Random-weight models of a real architecture's shape, made once under the cache with transformers'
own classes: bf16 safetensors with SmolLM2's tokenizer (their text is noise; the benchmarks that run
them ignore EOS and time fixed lengths)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def random_model(folder: str, name: str, config: str, shape: dict, after: Callable[[Path], None] | None = None,
                 config_keys: dict | None = None) -> Path:
    """The directory of transformers' `config` class with `shape`, random bf16 weights, under
    cache/folder/name (made on the first call; `after` then edits its files). `config_keys`: keys the
    published config.json carries beside what transformers' class writes (vLLM reads some of them:
    LFM2's conv_dim, DeepSeek-V3's topk_method). Its `complete` file holds the parameter count."""
    import torch
    import transformers as tf

    from pagedllm.loader import resolve_model_dir
    from pagedllm.util import cache_root

    out = cache_root() / folder / name
    if (out / "complete").is_file():
        return out
    torch.manual_seed(0)
    cfg = getattr(tf, config)(**shape)
    cfg.dtype = "bfloat16"
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    if config_keys:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_keys}, indent=2))
    if after is not None:
        after(out)
    for f in resolve_model_dir(None).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "complete").write_text(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
    return out
