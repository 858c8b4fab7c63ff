from . import torch_ref  # noqa: F401  (registers the reference backend)
from . import cpu_backend  # noqa: F401  (registers the compiled CPU kernel's backend)
from . import triton_backend  # noqa: F401  (registers the Triton backend where Triton imports)
from .backend import (AttentionBackend, PrefillSeq, SplitMetadata, StepLayout, get_backend, pad_rows,
                      pick_backend)
from .triton_backend import triton_available

__all__ = ["AttentionBackend", "PrefillSeq", "SplitMetadata", "StepLayout", "get_backend", "pad_rows",
           "pick_backend", "triton_available"]
