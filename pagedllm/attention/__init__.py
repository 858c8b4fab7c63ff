from . import torch_ref  # noqa: F401  (registers the reference backend)
from .backend import AttentionBackend, AttentionMetadata, PrefillSeq, get_backend, length_groups

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSeq", "get_backend", "length_groups"]
