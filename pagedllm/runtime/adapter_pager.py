"""The runner's side of LoRA: adapters read from disk into host memory (lora.registry's cache,
max_cpu_loras), written into the KV pool's pages the manager gave them (lora.paged), and each
step's rows told which pages to read (lora.batch). The manager decides which pages hold which
adapter (StepPlan.adapter_loads / adapter_evictions); here the bytes meet the tensors."""
from __future__ import annotations

import torch

from ..config import EngineConfig
from ..distributed import TPGroup
from ..lora.adapter import LoRAAdapter, load_adapter
from ..lora.batch import LoRAStep, lora_step
from ..lora.paged import AdapterSlabs, PagedAdapter
from ..lora.registry import AdapterCache
from ..lora.request import LoRARequest
from ..models import ModelConfig
from ..plan import StepPlan
from .kv_cache import KVCache


def check_adapters(cfg: EngineConfig, mc: ModelConfig, device: torch.device, dtype: torch.dtype, kernels) -> None:
    """Adapters are read from the pool's pages by the compiled CPU kernel, or by Triton's on a GPU
    (lora.triton_sgmv): what lacks one is refused, before any weight is read; so are the layers
    adapters do not reach yet."""
    if mc.mla is not None:
        raise ValueError(f"enable_lora is not supported for {mc.model_type}: adapters do not reach its multi-head "
                         "latent attention's matmuls yet")
    if mc.trailing_mlps:
        raise ValueError(f"enable_lora is not supported for {mc.model_type}: adapters do not reach the MLP blocks "
                         "its layers run after their Mamba-2 or attention block yet")
    if cfg.quantization == "w8a8":
        raise ValueError("enable_lora with quantization w8a8 is not supported: SmoothQuant folds scales into the "
                         "matmuls' inputs (and v's outputs), which an adapter trained on the model as published "
                         "does not know; weight-only int8, int4 and gguf run adapters")
    if device.type == "cpu":
        if kernels is None or dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"enable_lora on the CPU runs adapters from the KV pool's pages in the compiled "
                             f"kernel: it needs bf16 or float32 and the kernels built, not {dtype}"
                             f"{'' if kernels is not None else ', no kernels'}")
    else:
        from ..attention import triton_available

        why = triton_available()
        if why is not None:
            raise ValueError(f"enable_lora on {device} runs adapters in Triton kernels: {why}")


class AdapterPager:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, kv_cache: KVCache, dtype: torch.dtype, tp: TPGroup,
                 kernels) -> None:
        self.mc, self.kv_cache, self.dtype, self.tp, self.kernels = mc, kv_cache, dtype, tp, kernels
        self.max_lora_rank = cfg.max_lora_rank
        self.slabs = AdapterSlabs(kv_cache.pools, kv_cache.layout, mc, dtype)
        self.loras: AdapterCache[LoRAAdapter] = AdapterCache(self._read, cfg.max_cpu_loras or cfg.max_loras)
        self.paged: dict[int, PagedAdapter] = {}
        self.unsent: list[tuple] = []   # rank 0, tensor parallel: events not yet sent to the other ranks

    def _read(self, req: LoRARequest) -> LoRAAdapter:
        """An adapter read from disk and sized in pages (the loader's thread: never the engine loop's)."""
        adapter = load_adapter(req, self.mc, self.max_lora_rank, self.dtype, (self.tp.rank, self.tp.size))
        adapter.num_pages = self.slabs.pages(adapter)
        if adapter.num_pages > self.kv_cache.num_blocks:
            raise ValueError(f"lora: {req.lora_name!r} takes {adapter.num_pages} KV pages and the pool has "
                             f"{self.kv_cache.num_blocks} blocks; raise kv_cache_memory")
        return adapter

    def place(self, plan: StepPlan) -> None:
        """Write the adapters the step placed into their pages; forget those evicted. Under tensor
        parallelism the other ranks do the same with their slices, told with the next forward."""
        events = [("evict", a) for a in plan.adapter_evictions] + \
            [("load", a, pages, self.loras.entries[a][0]) for a, pages in plan.adapter_loads]
        self.apply(events)
        if self.tp.distributed:
            self.unsent += events

    def take_unsent(self) -> list[tuple]:
        events, self.unsent = self.unsent, []
        return events

    def apply(self, events: list[tuple]) -> None:
        """("load", id, pages, its LoRARequest) / ("evict", id), in order."""
        for ev in events:
            if ev[0] == "evict":
                self.paged.pop(ev[1], None)
            else:
                _, a, pages, req = ev
                # rank 0's adapter was read before its request ran (at once from host memory);
                # another rank reads its slice now, the first time (kept as max_cpu_loras allows)
                self.paged[a] = self.slabs.place(self.loras.load_now(req), pages)

    def step(self, rows: dict[int, list[int]], device: torch.device) -> LoRAStep | None:
        """What the model's matmuls add for a step whose rows run under these adapters."""
        if not rows:
            return None
        return lora_step(rows, self.paged, self.kernels if device.type == "cpu" else None,
                         self.slabs.geometry.width, self.slabs.views[0][0])

    def close(self) -> None:
        self.loras.close()
