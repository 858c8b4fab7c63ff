"""`pagedllm kv-calc`: M_KV = 2*L*d_kv*S*b*bytes, and what fits a budget."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import DTYPE_ALIASES
from ..config import DTYPE_BYTES as ENGINE_DTYPES
from ..kv_dtype import KVDtype, canonical_kv_dtype, resolve_kv_dtype
from ..models.config import ModelConfig
from ..util import cdiv

# The engine's dtypes (weights, and KV unless kv_cache_dtype says otherwise) and their aliases.
DTYPE_BYTES = {**ENGINE_DTYPES, **{a: ENGINE_DTYPES[c] for a, c in DTYPE_ALIASES.items()}}
# Earlier spellings: --dtype fp8 / int8 meant 8-bit KV (bf16 weights).
_KV_ONLY = {"fp8": "fp8_e4m3", "int8": "int8"}


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """The model's parameters; active=True: those one token reads (a mixture of experts: its
    top k experts of each sparse layer, not all of them)."""
    h, kvd, qd = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim
    attn = h * (qd + 2 * kvd) + qd * h + 2 * h
    if cfg.qkv_bias:
        attn += qd + 2 * kvd
    if cfg.family.qk_norm:
        attn += 2 * cfg.head_dim
    elif cfg.family.qk_norm_whole:
        attn += qd + kvd
    total = sum(attn + _mlp_params(cfg, i, active) for i in range(cfg.num_layers))
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return total + embed + h


def _mlp_params(cfg: ModelConfig, layer: int, active: bool) -> int:
    h, m = cfg.hidden_size, cfg.moe
    if m is None or not m.is_sparse(layer):
        return 3 * h * cfg.intermediate_size
    experts = m.top_k if active else m.num_experts
    shared = 3 * h * m.shared_width + h if m.shared_width else 0
    return experts * 3 * h * m.width + h * m.num_experts + shared


@dataclass
class KVCalc:
    kv_cache_dtype: str
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_seq: int
    m_kv_bytes: int                 # for seq_len x batch: M_KV
    budget_bytes: int
    num_blocks: int
    paged_max_seqs: int             # sequences of seq_len that fit, paged
    reserve_max_seqs: int           # ...with a max_model_len reservation each
    weights_bytes: int
    active_weights_bytes: int = 0   # what one token reads (a mixture of experts: its top k experts)
    max_model_len_blocks: int = 0   # one sequence of max_model_len tokens, paged

    def as_dict(self) -> dict:
        return asdict(self)


def kv_calc(cfg: ModelConfig, dtype: str = "bfloat16", seq_len: int = 2048, batch: int = 1,
            block_size: int = 16, budget_bytes: int | None = None, max_model_len: int | None = None,
            device_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
            kv_cache_dtype: str = "auto", weights_bytes: int | None = None) -> KVCalc:
    """budget_bytes is the KV pool; or give device_bytes and the budget is
    device * utilization - weights (vLLM's meaning, activations ignored). kv_cache_dtype:
    how K/V are stored (auto: as dtype), as the engine's flag. weights_bytes: the weights' real
    bytes where they are not the parameters in dtype (a GGUF file's blocks); a mixture's active
    bytes scale with them."""
    if dtype in _KV_ONLY and kv_cache_dtype == "auto":
        dtype, kv_cache_dtype = "bfloat16", _KV_ONLY[dtype]
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if seq_len < 1 or batch < 1 or block_size < 1:
        raise ValueError("seq_len, batch and block_size must be >= 1")
    elt = DTYPE_BYTES[dtype]
    kv = resolve_kv_dtype(canonical_kv_dtype(kv_cache_dtype), DTYPE_ALIASES.get(dtype, dtype))
    kv.check_head_dim(cfg.head_dim)
    bpt = cfg.kv_bytes_per_token(kv)
    bpb = bpt * block_size
    weights = param_count(cfg) * elt if weights_bytes is None else weights_bytes
    active = param_count(cfg, active=True) * weights // param_count(cfg)
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
    return KVCalc(kv_cache_dtype=kv.name, bytes_per_token=bpt, bytes_per_block=bpb, blocks_per_seq=per_seq,
                  m_kv_bytes=bpt * seq_len * batch,
                  budget_bytes=budget_bytes, num_blocks=num_blocks, paged_max_seqs=num_blocks // per_seq,
                  reserve_max_seqs=num_blocks // reserve, weights_bytes=weights,
                  active_weights_bytes=active, max_model_len_blocks=reserve)


def format_calc(name: str, c: KVCalc, seq_len: int, batch: int, block_size: int, dtype: str,
                max_model_len: int) -> str:
    gib = 2**30
    return "\n".join([
        f"KV cache arithmetic for {name} ({dtype}, KV {c.kv_cache_dtype}, block size {block_size})",
        f"  bytes per token (2*L*d_kv*bytes):   {c.bytes_per_token:,}" + _scales_note(c.kv_cache_dtype),
        f"  blocks per GiB:                     {2**30 // c.bytes_per_block:,}",
        f"  bytes per block:                    {c.bytes_per_block:,}",
        f"  M_KV for S={seq_len}, b={batch}:   {c.m_kv_bytes:,} bytes ({c.m_kv_bytes / gib:.3f} GiB)",
        f"  blocks per sequence ceil(S/B):      {c.blocks_per_seq}",
        f"  weights:                            {c.weights_bytes / gib:.2f} GiB"
        + (f" ({c.active_weights_bytes / gib:.2f} GiB active a token: its experts)"
           if c.active_weights_bytes != c.weights_bytes else ""),
        f"  KV budget: {c.budget_bytes / gib:.2f} GiB = {c.num_blocks:,} blocks",
        f"  sequences of {seq_len} tokens that fit: paged {c.paged_max_seqs:,}; "
        f"reserve-max (max_model_len {max_model_len}) {c.reserve_max_seqs:,}",
        f"  one sequence of max_model_len {max_model_len}: {c.max_model_len_blocks:,} blocks: "
        + ("fits" if c.max_model_len_blocks <= c.num_blocks else
           f"does NOT fit the {c.num_blocks:,} blocks (vLLM would refuse to start; lower --max-model-len)"),
    ])


def _scales_note(kv_cache_dtype: str) -> str:
    from ..kv_dtype import KV_DTYPES, SCALE_BYTES
    kv: KVDtype = KV_DTYPES[kv_cache_dtype]
    return f" (bytes = {kv.bits}/8, + a {SCALE_BYTES}-byte scale per head)" if kv.quantized else ""
