"""What is done to a prompt's pooled hidden state before anyone reads it as an embedding:
truncated to a model's Matryoshka dimensions where asked, and L2-normalized (as vLLM's
pooler and OpenAI's embeddings are), and how two embeddings score (cosine, /score and
/rerank's for an embedding model). Plain Python: a vector is a few thousand floats."""
from __future__ import annotations

import math
from collections.abc import Sequence


def pooled(vec: Sequence[float] | None, normalize: bool = True, dimensions: int | None = None) -> list[float]:
    if vec is None:
        raise RuntimeError("the engine returned no embedding for a pooling request")
    out = list(vec[:dimensions] if dimensions is not None else vec)
    if normalize:
        norm = math.sqrt(math.fsum(x * x for x in out))
        if norm > 0:
            out = [x / norm for x in out]
    return out


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(math.fsum(x * x for x in a)), math.sqrt(math.fsum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0
