"""`pagedllm kv-calc`: M_KV = 2*L*d_kv*S*b*bytes, and what fits a budget."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import DTYPE_ALIASES
from ..config import DTYPE_BYTES as ENGINE_DTYPES
from ..models.config import ModelConfig
from ..util import cdiv

# The engine's dtypes and their aliases, plus the 8-bit KV formats other engines offer (for comparison).
DTYPE_BYTES = {**ENGINE_DTYPES, **{a: ENGINE_DTYPES[c] for a, c in DTYPE_ALIASES.items()}, "fp8": 1, "int8": 1}


def param_count(cfg: ModelConfig) -> int:
    h, kvd, qd = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim
    per_layer = h * (qd + 2 * kvd) + qd * h + 3 * h * cfg.intermediate_size + 2 * h
    if cfg.qkv_bias:
        per_layer += qd + 2 * kvd
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * per_layer + embed + h


@dataclass
class KVCalc:
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_seq: int
    m_kv_bytes: int                 # for seq_len x batch: M_KV
    budget_bytes: int
    num_blocks: int
    paged_max_seqs: int             # sequences of seq_len that fit, paged
    reserve_max_seqs: int           # ...with a max_model_len reservation each
    weights_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def kv_calc(cfg: ModelConfig, dtype: str = "bfloat16", seq_len: int = 2048, batch: int = 1,
            block_size: int = 16, budget_bytes: int | None = None, max_model_len: int | None = None,
            device_bytes: int | None = None, gpu_memory_utilization: float = 0.9) -> KVCalc:
    """budget_bytes is the KV pool; or give device_bytes and the budget is
    device * utilization - weights (vLLM's meaning, activations ignored)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if seq_len < 1 or batch < 1 or block_size < 1:
        raise ValueError("seq_len, batch and block_size must be >= 1")
    elt = DTYPE_BYTES[dtype]
    bpt = cfg.kv_bytes_per_token(elt)
    bpb = bpt * block_size
    weights = param_count(cfg) * elt
    if budget_bytes is None:
        if device_bytes is None:
            budget_bytes = bpt * seq_len * batch
        else:
            budget_bytes = int(device_bytes * gpu_memory_utilization) - weights
    if budget_bytes < bpb:
        raise ValueError(f"the KV budget ({budget_bytes} bytes) is smaller than one block ({bpb} bytes)")
    num_blocks = budget_bytes // bpb
    per_seq = cdiv(seq_len, block_size)
    reserve = cdiv(max_model_len or cfg.max_position_embeddings, block_size)
    return KVCalc(bytes_per_token=bpt, bytes_per_block=bpb, blocks_per_seq=per_seq,
                  m_kv_bytes=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * seq_len * batch * elt,
                  budget_bytes=budget_bytes, num_blocks=num_blocks, paged_max_seqs=num_blocks // per_seq,
                  reserve_max_seqs=num_blocks // reserve, weights_bytes=weights)


def format_calc(name: str, c: KVCalc, seq_len: int, batch: int, block_size: int, dtype: str,
                max_model_len: int) -> str:
    gib = 2**30
    return "\n".join([
        f"KV cache arithmetic for {name} ({dtype}, block size {block_size})",
        f"  bytes per token (2*L*d_kv*bytes):   {c.bytes_per_token:,}",
        f"  bytes per block:                    {c.bytes_per_block:,}",
        f"  M_KV for S={seq_len}, b={batch}:   {c.m_kv_bytes:,} bytes ({c.m_kv_bytes / gib:.3f} GiB)",
        f"  blocks per sequence ceil(S/B):      {c.blocks_per_seq}",
        f"  weights:                            {c.weights_bytes / gib:.2f} GiB",
        f"  KV budget: {c.budget_bytes / gib:.2f} GiB = {c.num_blocks:,} blocks",
        f"  sequences of {seq_len} tokens that fit: paged {c.paged_max_seqs:,}; "
        f"reserve-max (max_model_len {max_model_len}) {c.reserve_max_seqs:,}",
    ])
