"""Random-weight models of real shapes (`pagedllm bench make-model --shape tinyllama-1.1b`):
where matmuls dominate, speed is measured on a 1B-class shape without downloading it. A
model directory in HF's layout (config.json, model.safetensors, the default model's
tokenizer), so every engine (ours, HF transformers, vLLM) loads the same files.

The weights are N(0, 0.02) (norms 1), so the text is noise: run such a model with fixed
output lengths (ignore_eos). The vocabulary is the shape's, but never smaller than the
tokenizer's (TinyLlama's 32,000 becomes SmolLM2's 49,152), so every id it makes is a row."""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.registry import family


@dataclass(frozen=True)
class Shape:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool = False  # Qwen2's q/k/v biases


# As their published config.json files give them (Llama-3.2's rope scaling left out: it
# changes no matmul).
SHAPES = {
    "tinyllama-1.1b": Shape("llama", 2048, 22, 32, 4, 5632, 32000, False, 10000.0, 2048),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, 8192),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1000000.0, 32768, attention_bias=True),
}


def _tensors(s: Shape, vocab: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = s.hidden_size // s.num_attention_heads

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    out = {"model.embed_tokens.weight": rand(vocab, s.hidden_size), "model.norm.weight": torch.ones(s.hidden_size, dtype=dtype)}
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = rand(vocab, s.hidden_size)
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}."
        sizes = {"q": s.num_attention_heads * d, "k": s.num_key_value_heads * d, "v": s.num_key_value_heads * d}
        for name, n in sizes.items():
            out[f"{p}self_attn.{name}_proj.weight"] = rand(n, s.hidden_size)
            if s.attention_bias:
                out[f"{p}self_attn.{name}_proj.bias"] = rand(n)
        out[f"{p}self_attn.o_proj.weight"] = rand(s.hidden_size, s.num_attention_heads * d)
        out[f"{p}mlp.gate_proj.weight"] = rand(s.intermediate_size, s.hidden_size)
        out[f"{p}mlp.up_proj.weight"] = rand(s.intermediate_size, s.hidden_size)
        out[f"{p}mlp.down_proj.weight"] = rand(s.hidden_size, s.intermediate_size)
        out[f"{p}input_layernorm.weight"] = torch.ones(s.hidden_size, dtype=dtype)
        out[f"{p}post_attention_layernorm.weight"] = torch.ones(s.hidden_size, dtype=dtype)
    return out


def make_model(shape: str, out: str | Path, dtype: str = "bfloat16", seed: int = 0, tokenizer_from: str | None = None) -> Path:
    """Write a random-weight model of `shape` to `out` (created, or replaced when it holds
    another shape). Returns its path. A complete directory of the same shape, dtype and
    seed is kept as it is."""
    from ..loader import load_tokenizer, resolve_model_dir

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    s, out = SHAPES[shape], Path(out).expanduser()
    stamp = json.dumps({"shape": shape, "dtype": dtype, "seed": seed, **asdict(s)}, sort_keys=True)
    if (out / "complete").is_file() and (out / "complete").read_text() == stamp:
        return out
    src = resolve_model_dir(tokenizer_from)
    tok = load_tokenizer(src)
    vocab = max(s.vocab_size, len(tok))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in src.iterdir():  # the tokenizer's files and the chat template
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    d = s.hidden_size // s.num_attention_heads
    arch = family(s.model_type).architecture   # what HF transformers and vLLM build it as
    config = {
        "architectures": [arch], "model_type": s.model_type, "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "intermediate_size": s.intermediate_size, "head_dim": d,
        "vocab_size": vocab, "tie_word_embeddings": s.tie_word_embeddings, "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_position_embeddings, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "attention_bias": s.attention_bias, "torch_dtype": dtype, "dtype": dtype,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "pagedllm_random_shape": shape,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id,
                                                            "eos_token_id": tok.eos_token_id}, indent=2))
    save_file(_tensors(s, vocab, getattr(torch, dtype), seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "complete").write_text(stamp)
    return out


def parameter_count(shape: str, vocab: int | None = None) -> int:
    s = SHAPES[shape]
    v = vocab or s.vocab_size
    d = s.hidden_size // s.num_attention_heads
    attn = s.hidden_size * d * (2 * s.num_attention_heads + 2 * s.num_key_value_heads)
    layer = attn + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size
    return v * s.hidden_size * (1 if s.tie_word_embeddings else 2) + s.num_hidden_layers * layer + s.hidden_size
