"""Where weights, config and tokenizer come from: a GGUF file or an HF model directory."""
from .model_files import (DEFAULT_MODEL_NAME, default_gguf_path, load_config, load_tokenizer, load_weights,
                          resolve_model_dir, served_model_name)

__all__ = ["DEFAULT_MODEL_NAME", "default_gguf_path", "load_config", "load_tokenizer", "load_weights", "resolve_model_dir",
           "served_model_name"]
