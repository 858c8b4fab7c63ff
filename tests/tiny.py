"""The tiny model: a random 2-layer Llama for the tests whose subject is a mechanism, not the model."""
from __future__ import annotations

import shutil
from pathlib import Path

TINY_NAME = "tiny-llama"   # the name servers of the tiny model answer to


def build_tiny_llama(out: Path, model_dir: Path) -> Path:
    """A 2-layer random Llama with the default model's tokenizer and chat template, for the tests
    whose subject is a mechanism (preemption, speculation, chunking, swapping, seeds, routing)
    rather than the model: the engine runs it ~30x faster than SmolLM2's 30 layers.

    Untied, with the input embedding added into the output head: the model leans towards
    tokens it has seen, so greedy output mixes fresh tokens with repeats (n-gram drafts are
    both accepted and rejected), and its logits are far from ties."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.add_(model.model.embed_tokens.weight * 1.5)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(model_dir, out)
    return out


def copy_tokenizer(model_dir: Path, out: Path) -> None:
    """The default model's tokenizer files and chat template, into a random model's folder."""
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
