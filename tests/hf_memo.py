"""HF transformers' generate(), the reference our engine's tokens and beams are held to, kept on
disk between runs.

The same weights, config, inputs and arguments give the same tokens under the same transformers,
torch and CPU, and computing them again each run cost ~80 of the suite's ~1,000 CPU-seconds (HF's
beam search most of it). So a result is kept under the user's cache (PAGEDLLM_CACHE), keyed by a
digest of all of that: the weights' bytes and the config (a model built with other random weights,
or a config edited in place, is another key), the call's tensors and arguments, the versions of
transformers and torch, and the CPU (fp32 rounding differs between Intel's and AMD's kernels).
PAGEDLLM_TEST_HF_FRESH=1 computes every reference again (and keeps it)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from pagedllm.kernels.chooser import cpu_name
from pagedllm.util import cache_root

# What the cached files hold: bump when the stored form changes.
FORMAT = 1


def _cpu() -> str:
    return f"{cpu_name()}|{torch.backends.cpu.get_cpu_capability()}"


def weights_digest(model) -> str:
    """A digest of the model's parameters and buffers (names, dtypes, shapes, bytes), computed
    once per model until a tensor of it is written in place (torch's version counters)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    versions = tuple((name, id(t), t._version) for name, t in tensors)
    seen = model.__dict__.get("_hf_memo_digest")
    if seen is not None and seen[0] == versions:
        return seen[1]
    h = hashlib.sha256()   # SHA extensions: ~1.8 GB/s, twice blake2b's
    for name, t in tensors:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())   # hashed in place, not copied
    model.__dict__["_hf_memo_digest"] = (versions, h.hexdigest())
    return h.hexdigest()


def _plain(value):
    """A JSON-able form of an argument of generate() (tensors as their values and dtype)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    return value


def _adapters(model) -> str | None:
    """A PeftModel's adapter settings and which is active: its scaling is not in the weights."""
    configs = getattr(model, "peft_config", None)
    if configs is None:
        return None
    as_list = lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)  # noqa: E731
    return json.dumps({"active": model.active_adapter, **{name: c.to_dict() for name, c in configs.items()}},
                      sort_keys=True, default=as_list)


def _config(model) -> dict:
    """The model's config without where it was loaded from (a test's temporary folder is another
    each run: the same model would never be found again)."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    return config


def _key(model, input_ids: torch.Tensor, kwargs: dict) -> str:
    import transformers

    parts = {"format": FORMAT, "class": type(model).__name__, "weights": weights_digest(model), "peft": _adapters(model),
             "config": _config(model),
             "generation_config": model.generation_config.to_json_string(use_diff=False),
             "input_ids": _plain(input_ids), "kwargs": _plain(kwargs),
             "transformers": transformers.__version__, "torch": torch.__version__, "cpu": _cpu()}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=20).hexdigest()


def _path(key: str) -> Path:
    return cache_root() / "hf-references" / key[:2] / f"{key}.json"


def generate(model, input_ids: torch.Tensor, **kwargs):
    """model.generate(input_ids, **kwargs) without gradients, from the disk when it was computed
    before: the sequences tensor, or with return_dict_in_generate=True a namespace of
    `sequences` and `sequences_scores` (beam search's; None otherwise)."""
    as_dict = kwargs.get("return_dict_in_generate", False)
    path = _path(_key(model, input_ids, kwargs))
    stored = None
    if path.exists() and not os.environ.get("PAGEDLLM_TEST_HF_FRESH"):
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = None   # a torn or unreadable file: computed again below
    if stored is None:
        with torch.no_grad():
            out = model.generate(input_ids, **kwargs)
        seqs = out.sequences if as_dict else out
        scores = getattr(out, "sequences_scores", None) if as_dict else None
        stored = {"sequences": seqs.tolist(), "scores": None if scores is None else scores.tolist()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored))
        os.replace(tmp, path)   # atomic: the other test worker reads a whole file or none
    seqs = torch.tensor(stored["sequences"], dtype=torch.long)
    if not as_dict:
        return seqs
    scores = None if stored["scores"] is None else torch.tensor(stored["scores"], dtype=torch.float32)
    return SimpleNamespace(sequences=seqs, sequences_scores=scores)
