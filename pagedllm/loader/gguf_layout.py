"""Where llama.cpp's GGUF files lay a model out otherwise than transformers: the q / k rows its
converter permutes for its RoPE layout (LlamaModel.permute), which every reader of such a file
(gguf_quant.py's blocks, gguf_moe.py's conversion) puts back."""
from __future__ import annotations

import torch

# llama.cpp's converter permutes q/k rows for these architectures only (its LlamaModel: Llama,
# Mistral, SmolLM2); Qwen2/3, Gemma 3 and Phi-3 files keep HF's row order.
PERMUTED_QK = ("llama",)


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's permute(w, n_head): it stored row (h, 2i + j) of
    HF's q/k weight at (h, j * dim/2 + i); HF row (h, j, i) sits at (h, i, j) there.
    Same as transformers' reverse_permute (reshape(n_head, dim/2, 2).swapaxes(1, 2))."""
    half = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, half, 2).transpose(1, 2).reshape(-1)
