"""Pooling on the generating server: POST /v1/embeddings (OpenAI's shape, float or base64,
`dimensions` where the model declares Matryoshka dimensions), /score (vLLM's text_1 /
text_2) and /rerank (Cohere's and Jina's query / documents, also under /v1 and /v2).

No second server or runner flag: each input is a one-token request whose prompt's last hidden
state the engine returns (SamplingParams.embed), prefilled in the same batches as everyone's
generations, its cached prefix blocks reused. A score is the cosine of two embeddings, as
vLLM's for an embedding model (no cross-encoder head here)."""
from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...pooling import cosine, pooled
from ...sampling_params import SamplingParams
from ..state import APIError, ServerState
from ..streaming import ClientGone, submit, whole

MAX_INPUTS = 256   # per request: more would queue one tenant's batch ahead of everyone's


class _Pooling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    user: str | None = None
    # vLLM's extras
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    priority: int = 0
    stream: Literal[False] = False   # what submit reads: pooling answers whole


class EmbeddingRequest(_Pooling):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)) and len(v) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request")
        return v

    def inputs(self) -> list[str | list[int]]:
        v = self.input
        if isinstance(v, str) or all(isinstance(t, int) for t in v):
            return [v]
        return list(v)


class ScoreRequest(_Pooling):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Pooling):
    query: str
    documents: list[str] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True


async def embeddings(state: ServerState, request: Request) -> dict:
    key = state.authenticate(request)
    req: EmbeddingRequest = state.parse(EmbeddingRequest, await state.read_json(request))
    dims = _dimensions(state, req.dimensions)
    texts = req.inputs()
    vectors, used = await _embed(state, request, req, texts, key, _numbered("input", len(texts)))
    data = [{"object": "embedding", "index": i, "embedding": _encoded(pooled(v, True, dims), req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": used, "total_tokens": used}}


async def score(state: ServerState, request: Request) -> dict:
    key = state.authenticate(request)
    req: ScoreRequest = state.parse(ScoreRequest, await state.read_json(request))
    left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not left or not right or (len(left) != 1 and len(left) != len(right)):
        raise APIError(400, f"text_1: one text, or one per text_2 ({len(right)}); got {len(left)}", param="text_1")
    if len(left) + len(right) > MAX_INPUTS:
        raise APIError(400, f"text_2: at most {MAX_INPUTS} texts per request in all", param="text_2")
    vectors, used = await _embed(state, request, req, left + right, key,
                                 _numbered("text_1", len(left)) + _numbered("text_2", len(right)))
    a, b = vectors[:len(left)], vectors[len(left):]
    pairs = [(a[0] if len(a) == 1 else a[i], v) for i, v in enumerate(b)]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.model_name, "usage": {"prompt_tokens": used, "total_tokens": used},
            "data": [{"index": i, "object": "score", "score": cosine(x, y)} for i, (x, y) in enumerate(pairs)]}


async def rerank(state: ServerState, request: Request) -> dict:
    key = state.authenticate(request)
    req: RerankRequest = state.parse(RerankRequest, await state.read_json(request))
    vectors, used = await _embed(state, request, req, [req.query, *req.documents], key,
                                 [("query", "query")] + _numbered("documents", len(req.documents), always=True))
    results = [{"index": i, "relevance_score": cosine(vectors[0], v)} for i, v in enumerate(vectors[1:])]
    results.sort(key=lambda r: -r["relevance_score"])
    if req.top_n is not None:
        results = results[:req.top_n]
    if req.return_documents:
        for r in results:
            r["document"] = {"text": req.documents[r["index"]]}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name, "usage": {"total_tokens": used},
            "results": results}


def _numbered(field: str, n: int, always: bool = False) -> list[tuple[str, str]]:
    """(what an error calls text i, its param) for n texts of one field: "input 2", or "input" alone."""
    return [(f"{field} {i}" if n > 1 or always else field, field) for i in range(n)]


async def _embed(state: ServerState, request: Request, req: _Pooling, texts: list, key: str | None,
                 names: list[tuple[str, str]]) -> tuple[list[list[float]], int]:
    """Each text's raw embedding (its last hidden state), and the prompt tokens they took; names:
    each text's (label, param) for an error about it."""
    params = SamplingParams(max_tokens=1, temperature=0, embed=True)
    prompts = await state.off_loop(_token_ids, state, texts, params, names)
    sub = await submit(state, request, req, "embd", prompts, params, key)
    try:
        finals = await whole(_finals(sub.merged))
    except ClientGone:
        raise APIError(499, "the client went away") from None
    return [finals[i].embedding for i in range(len(prompts))], sum(map(len, prompts))


async def _finals(merged) -> dict:
    out = {}
    async for i, o in merged:
        if o.finished:
            if o.error is not None:
                raise APIError(400, o.error) if o.error_invalid else APIError(500, o.error, "internal_error")
            out[i] = o
    return out


def _token_ids(state: ServerState, texts: list, params: SamplingParams, names: list[tuple[str, str]]) -> list[list[int]]:
    out = []
    for t, (label, param) in zip(texts, names):
        try:
            out.append(state.engine.validate(t, params, add_special_tokens=True))
        except ValueError as e:
            raise APIError(400, f"{label}: {e}", param=param) from None
    return out


def _dimensions(state: ServerState, dims: int | None) -> int | None:
    if dims is None:
        return None
    allowed = matryoshka_dimensions(state.engine.info.model_dir)
    if allowed is None:
        raise APIError(400, "dimensions: this model declares no Matryoshka dimensions (is_matryoshka or "
                            "matryoshka_dimensions in its config.json), so its vectors cannot be shortened",
                       param="dimensions")
    if dims not in allowed:
        raise APIError(400, f"dimensions: {dims} is not one of the model's {sorted(allowed)}", param="dimensions")
    return dims


@lru_cache(maxsize=8)
def matryoshka_dimensions(model_dir: Path) -> frozenset[int] | None:
    """The lengths an embedding may be cut to, as the model's config declares them
    (vLLM reads the same keys); None where it declares none."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if cfg.get("matryoshka_dimensions"):
        return frozenset(int(d) for d in cfg["matryoshka_dimensions"])
    if cfg.get("is_matryoshka"):
        return frozenset(range(1, int(cfg.get("hidden_size", 0)) + 1))
    return None


def _encoded(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: little-endian float32s
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec

