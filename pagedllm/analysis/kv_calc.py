"""`pagedllm kv-calc`: M_KV = 2*L*d_kv*S*b*bytes, and what fits a budget.

What fits is counted as the engine counts it (kv.groups): a pool block holds g layer slots (g: the
fewest layers of any attention type), each group of layers keeps its own blocks, a windowed group
only its window's, a hybrid's state group one or two a sequence (the state after the last token,
in the slots' K/V rows). A model of one attention type has one group of every layer: M_KV's
arithmetic as it is."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import DTYPE_ALIASES
from ..config import DTYPE_BYTES as ENGINE_DTYPES
from ..kv.groups import KV, KVLayout, held_blocks, kv_layout
from ..kv_dtype import KVDtype, canonical_kv_dtype, resolve_kv_dtype
from ..models.config import ModelConfig
from ..util import cdiv

# The engine's dtypes (weights, and KV unless kv_cache_dtype says otherwise) and their aliases.
DTYPE_BYTES = {**ENGINE_DTYPES, **{a: ENGINE_DTYPES[c] for a, c in DTYPE_ALIASES.items()}}
# Earlier spellings: --dtype fp8 / int8 meant 8-bit KV (bf16 weights).
_KV_ONLY = {"fp8": "fp8_e4m3", "int8": "int8"}


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """The model's parameters, counted on the model itself built on torch's meta device (no
    memory, no values: ~10 ms): every family's layers as they run, a hybrid's mixers, latent
    attention and MLP blocks included, where a formula of attention and MLP shapes was off by
    4-15 % for them. active=True: those one token reads (a mixture of experts: its top k experts
    of each sparse layer, not all of them)."""
    import torch

    from ..attention.backend import get_backend
    from ..models.registry import decoder_for

    with torch.device("meta"):
        model = decoder_for(cfg.model_type)(cfg, get_backend("torch"))
    total = sum(p.numel() for p in model.parameters())
    return total - _unread_expert_params(cfg) if active else total


def _unread_expert_params(cfg: ModelConfig) -> int:
    """A mixture's experts a token does not read (num_experts - top_k of each sparse layer); 0
    for a dense model."""
    return sum(_mlp_params(cfg, i, False) - _mlp_params(cfg, i, True) for i in range(cfg.num_layers))


def _mlp_params(cfg: ModelConfig, layer: int, active: bool) -> int:
    """A layer's MLP parameters by its shapes (a mixture's experts, all or its top k): what a
    token does not read is the difference."""
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
    groups: tuple[str, ...] = ("full",)   # the pool's layer groups' kinds (a block holds one group's)
    state_blocks_per_seq: int = 0   # of blocks_per_seq: a hybrid's state groups' (a state a group)
    max_tokens: int = 0             # tokens of K/V the pool holds (every KV group's blocks for each)
    reserve_num_blocks: int = 0     # the budget in reserve-max's blocks (one table: every layer's K/V); 0: refused

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
    layout = engine_groups(cfg)
    bpb = block_bytes(cfg, kv, layout, block_size)
    total = param_count(cfg)
    weights = total * elt if weights_bytes is None else weights_bytes
    active = (total - _unread_expert_params(cfg)) * weights // total
    if budget_bytes is None:
        if device_bytes is None:
            budget_bytes = bpt * seq_len * batch
        else:
            budget_bytes = int(device_bytes * gpu_memory_utilization) - weights
    if budget_bytes < bpb:
        raise ValueError(f"the KV budget ({budget_bytes} bytes) is smaller than one block ({bpb} bytes)")
    num_blocks = budget_bytes // bpb
    per_seq = held_blocks(layout.windows, seq_len, block_size)
    state = held_blocks([g.window for g in layout.groups if g.holds != KV], seq_len, block_size)
    longest = max_model_len or cfg.max_position_embeddings
    # reserve-max reserves max_model_len in one table a sequence: every layer's K/V in a block
    # (a state model has no such table: 0)
    one_table = kv.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.pool_v_dim) * block_size
    reserve_blocks = 0 if layout.has_state else budget_bytes // one_table
    reserve_seqs = reserve_blocks // cdiv(longest, block_size)
    return KVCalc(kv_cache_dtype=kv.name, bytes_per_token=bpt, bytes_per_block=bpb, blocks_per_seq=per_seq,
                  m_kv_bytes=bpt * seq_len * batch,
                  budget_bytes=budget_bytes, num_blocks=num_blocks, paged_max_seqs=num_blocks // per_seq,
                  reserve_max_seqs=reserve_seqs, weights_bytes=weights,
                  active_weights_bytes=active, max_model_len_blocks=held_blocks(layout.windows, longest, block_size),
                  groups=tuple(g.kind for g in layout.groups), state_blocks_per_seq=state,
                  max_tokens=_max_tokens(layout, num_blocks, block_size), reserve_num_blocks=reserve_blocks)


def block_bytes(cfg: ModelConfig, kv: KVDtype, layout: KVLayout, block_size: int) -> int:
    """A pool block's bytes in `layout`: its g layer slots' K/V (a state layer's slot holds its
    state in them; ValueError where the state does not fit, as the engine refuses it)."""
    if layout.has_state:
        cfg.check_state_room(block_size, (cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.pool_v_dim))
    return kv.bytes_per_token(layout.layers_per_block, cfg.num_kv_heads, cfg.head_dim, cfg.pool_v_dim) * block_size


def engine_groups(cfg: ModelConfig) -> KVLayout:
    """The layer groups a paged engine lays this model's pool out in (kv.groups.kv_layout)."""
    return kv_layout([cfg.window(i) for i in range(cfg.num_layers)], cfg.state_layers)


def _max_tokens(layout: KVLayout, num_blocks: int, block_size: int) -> int:
    """The tokens of K/V a pool of num_blocks holds, as the engine logs it: each KV group keeps a
    block for its tokens' blocks (a state group a block a sequence, not counted)."""
    return num_blocks * block_size // max(1, sum(1 for g in layout.groups if g.holds == KV))


def format_calc(name: str, c: KVCalc, seq_len: int, batch: int, block_size: int, dtype: str,
                max_model_len: int) -> str:
    gib = 2**30
    return "\n".join([
        f"KV cache arithmetic for {name} ({dtype}, KV {c.kv_cache_dtype}, block size {block_size})",
        f"  bytes per token (2*L*d_kv*bytes):   {c.bytes_per_token:,}" + _scales_note(c.kv_cache_dtype),
        f"  blocks per GiB:                     {2**30 // c.bytes_per_block:,}",
        f"  bytes per block:                    {c.bytes_per_block:,}",
        f"  M_KV for S={seq_len}, b={batch}:   {c.m_kv_bytes:,} bytes ({c.m_kv_bytes / gib:.3f} GiB)",
        f"  blocks per sequence{' ceil(S/B):     ' if len(c.groups) == 1 else ':               '} {c.blocks_per_seq}"
        + _groups_note(c),
        f"  weights:                            {c.weights_bytes / gib:.2f} GiB"
        + (f" ({c.active_weights_bytes / gib:.2f} GiB active a token: its experts)"
           if c.active_weights_bytes != c.weights_bytes else ""),
        f"  KV budget: {c.budget_bytes / gib:.2f} GiB = {c.num_blocks:,} blocks",
        f"  sequences of {seq_len} tokens that fit: paged {c.paged_max_seqs:,}; "
        + (f"reserve-max (max_model_len {max_model_len}) {c.reserve_max_seqs:,}" if not c.state_blocks_per_seq
           else "reserve-max: not run (a recurrent state keeps block tables of its own)"),
        f"  one sequence of max_model_len {max_model_len}: {c.max_model_len_blocks:,} blocks: "
        + ("fits" if c.max_model_len_blocks <= c.num_blocks else
           f"does NOT fit the {c.num_blocks:,} blocks (vLLM would refuse to start; lower --max-model-len)"),
    ])


def _groups_note(c: KVCalc) -> str:
    """How a sequence's blocks split over the layer groups, where there are several."""
    if len(c.groups) == 1:
        return ""
    kinds = ", ".join(f"{c.groups.count(k)} {k}" for k in dict.fromkeys(c.groups))
    state = f", {c.state_blocks_per_seq} of them state" if c.state_blocks_per_seq else ""
    return f" over {len(c.groups)} layer groups ({kinds}; a block holds one group's){state}"


def _scales_note(kv_cache_dtype: str) -> str:
    from ..kv_dtype import KV_DTYPES, SCALE_BYTES
    kv: KVDtype = KV_DTYPES[kv_cache_dtype]
    return f" (bytes = {kv.bits}/8, + a {SCALE_BYTES}-byte scale per head)" if kv.quantized else ""
