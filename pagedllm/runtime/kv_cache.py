"""The KV pools: preallocated K and V tensors, a block per row (the attention backend picks
the layout inside a block), sized from the memory budget.

One K/V pair per layer slot of the KV layout (kv.groups): a model of one attention type has a
slot per layer; a model whose layers mix attention types has g slots, each shared by layer i
of every layer group, so one block id holds the g layers of whichever group owns it."""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from ..attention import AttentionBackend
from ..config import EngineConfig
from ..distributed import TPGroup
from ..kv import KVLayout
from ..kv.groups import KV
from ..models import ModelConfig
from .host_pages import mapped, populate_all

logger = logging.getLogger(__name__)

_CPU_DEFAULT_CAP = 2 * 1024**3


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Beyond the profiled peak: CUDA graphs' own pool, allocator fragmentation.
_CUDA_MARGIN = 256 * 1024**2


def kv_budget(cfg: EngineConfig, device: torch.device, profile: Callable[[], int] | None = None) -> int:
    """Bytes for KV blocks. CPU: kv_cache_memory, else min(2 GiB, 25 % of free RAM).
    CUDA: gpu_memory_utilization of the device, less what weights and the rest of the
    process already hold and the activations of the largest step as the profile run
    measured them (`profile`, run only here), unless kv_cache_memory says otherwise."""
    if cfg.kv_cache_memory is not None:
        return int(cfg.kv_cache_memory)
    if device.type == "cuda":
        activations = (512 * 1024**2 if profile is None else profile()) + _CUDA_MARGIN
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = int(total * cfg.gpu_memory_utilization) - in_use - activations
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization {cfg.gpu_memory_utilization} leaves no room for KV "
                             f"({in_use / 2**30:.1f} GiB already in use of {total / 2**30:.1f} GiB)")
        return budget
    return min(_CPU_DEFAULT_CAP, available_ram() // 4)


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zeroed pool (allocate_pools)."""
    return allocate_pools([shape], dtype, device)[0]


def allocate_pools(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zeroed pools. Zeroed, not empty: attention masks padded slots to weight 0, but 0 * NaN
    from uninitialised memory would still poison the output.

    On CPU, each a private anonymous mapping of its own, which the kernel hands out zeroed (no
    pool reuses another's freed memory). Its pages are asked to be 2 MiB huge pages before first
    touch: blocks are read in table order, all over the pool, and 4 KiB pages then cost a TLB
    miss per block (decode attention measured 1.2-1.4x faster with huge pages). Then they are
    faulted in, all at once, at start-up, on a few threads (host_pages.populate_all; see
    populate_wanted)."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    pools = [mapped(shape, dtype) for shape in shapes]
    if populate_wanted():
        populate_all(pools)
    return pools


def populate_wanted() -> bool:
    """PAGEDLLM_KV_POPULATE=0 leaves a CPU pool to be faulted in page by page as blocks are first
    written: an engine then holds only the RAM its blocks have reached, and starts at once (the
    test suite, which starts a hundred short-lived engines). The default faults it all in at
    start-up, as vLLM's torch.zeros does: a run's first pass over the pool otherwise pays the
    faults (and, with huge pages on a fragmented machine, the kernel's compaction for them)
    inside its timed steps: measured 0.91x offline throughput on a cold 96-prompt pass."""
    return os.environ.get("PAGEDLLM_KV_POPULATE", "1").strip() != "0"


class KVCache:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, profile: Callable[[], int] | None = None, tp: TPGroup | None = None,
                 extra_bytes_per_token: int = 0, layout: KVLayout | None = None) -> None:
        """model_cfg: this rank's slice under tensor parallelism (its KV heads). Every
        rank holds the same number of blocks (the fewest any can fit): rank 0's block
        tables index all the pools. extra_bytes_per_token: another pool of as many blocks
        shares the budget (a draft model's KV). The backend lays the blocks out and says
        how K/V are stored (its kv dtype: as computed, or quantized). layout: the layer
        groups (default: one group of every layer)."""
        tp = tp or TPGroup()
        self.layout = layout or KVLayout.single(model_cfg.num_layers)
        self.kv_dtype = backend.kv_dtype_of(dtype)
        # M_KV per token over every layer; a pool block holds the layout's g layer slots of B tokens.
        self.bytes_per_token = model_cfg.kv_bytes_per_token(self.kv_dtype)
        # A block's bytes: its g layer slots' K/V (a state layer's slot holds its state in those bytes).
        self.bytes_per_block = self.kv_dtype.bytes_per_token(self.layout.layers_per_block, model_cfg.num_kv_heads,
                                                             model_cfg.head_dim, model_cfg.pool_v_dim) * cfg.block_size
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
        else:
            budget = kv_budget(cfg, device, profile)
            if device.type == "cpu":  # the machine's ranks share its RAM: the budget is theirs together
                budget //= tp.local_size
            num_blocks = tp.min(budget // (self.bytes_per_block + extra_bytes_per_token * cfg.block_size))
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory {budget} bytes is smaller than one KV block "
                                 f"({self.bytes_per_block} bytes at block_size {cfg.block_size})")
        self.num_blocks = num_blocks
        self.block_size = cfg.block_size
        # One (K, V) pair per layer slot; each model layer reads and writes its slot's pair.
        self.pools = allocate_layers(model_cfg, num_blocks, cfg.block_size, backend.pool_dtype(dtype), device,
                                     backend.cache_shapes, self.layout.layers_per_block)
        self.layers = [self.pools[self.layout.place(i)[1]] for i in range(model_cfg.num_layers)]
        log = logger.info if tp.is_driver else logger.debug
        groups = self.layout.groups
        log("KV cache: %d blocks x %d tokens, %s, %d bytes/token (2*L*d_kv*bytes%s), %.2f GiB, max %d tokens%s%s",
            num_blocks, cfg.block_size, self.kv_dtype.name, self.bytes_per_token,
            " + scales" if self.kv_dtype.quantized else "", num_blocks * self.bytes_per_block / 2**30,
            num_blocks * cfg.block_size // sum(1 for g in groups if g.holds == KV),  # a state group: a block a sequence
            f" (per rank, {tp.size} ranks)" if tp.size > 1 else "",
            "" if len(groups) == 1 else f"; {len(groups)} layer groups of {self.layout.layers_per_block} layers "
            f"({', '.join(g.kind for g in groups)}), a block holds one group's")

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Carry out copy-on-write / fork copies decided by the KV manager."""
        copy_blocks(self.pools, pairs)


def check_state_model(cfg: EngineConfig, mc: ModelConfig, kv: KVCache) -> None:
    """ValueError naming what a model whose layers keep a recurrent state in the pool's blocks
    does not run with: speculation (a state cannot be rolled back), quantized KV (the state is
    kept as computed), a block too small for its state."""
    if cfg.speculative_config is not None:
        raise ValueError(f"speculative decoding is not supported for {mc.model_type}: its layers "
                         f"{list(mc.state_layers)} update a recurrent state in place, which rejected drafts "
                         "cannot take back")
    if kv.kv_dtype.quantized:
        raise ValueError(f"kv_cache_dtype {kv.kv_dtype.name} is not supported for {mc.model_type}: its state "
                         "layers keep their state in the KV blocks as computed; use kv_cache_dtype auto")
    k_pool, v_pool = kv.pools[0]
    mc.check_state_room(cfg.block_size, (k_pool[0].numel() // cfg.block_size, v_pool[0].numel() // cfg.block_size))


def allocate_layers(mc: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                    cache_shapes: Callable[..., tuple[tuple[int, ...], tuple[int, ...]]],
                    num_slots: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A (K, V) pool of num_blocks blocks per layer slot (default: per layer of `mc`), in the backend's layout."""
    k_shape, v_shape = cache_shapes(num_blocks, block_size, mc.num_kv_heads, mc.head_dim, dtype, mc.pool_v_dim)
    pools = allocate_pools([k_shape, v_shape] * (mc.num_layers if num_slots is None else num_slots), dtype, device)
    return list(zip(pools[::2], pools[1::2]))


def copy_blocks(layers: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer's K and V pools."""
    if not pairs:
        return
    dev = layers[0][0].device
    src = torch.tensor([p[0] for p in pairs], device=dev)
    dst = torch.tensor([p[1] for p in pairs], device=dev)
    for k, v in layers:
        k[dst] = k[src]
        v[dst] = v[src]
