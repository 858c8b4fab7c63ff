"""The adapters a runner holds: loaded on a request's first use, at most `capacity` at once;
when a new one needs room, the least recently used adapter that no unfinished request holds
is dropped (reloaded from its path if asked for again). An adapter is ref-counted by the
requests that use it."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..models import ModelConfig
from .adapter import LoRAAdapter, load_adapter
from .request import LoRARequest


class AdaptersBusyError(ValueError):
    """Every held adapter is in use and a new one needs room: retry when a request finishes
    (the server's 503)."""


class LoRARegistry:
    def __init__(self, mc: ModelConfig, dtype: torch.dtype, max_rank: int, capacity: int) -> None:
        self.mc, self.dtype, self.max_rank, self.capacity = mc, dtype, max_rank, capacity
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()   # least recently used first
        self.refs: dict[int, int] = {}
        self.loads = 0   # adapters read from disk, reloads included

    def acquire(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of `req`, loaded if it is not held; one more request holds it. Raises
        ValueError when it cannot be read, or when every held adapter is in use and there is
        no room for it."""
        held = self.adapters.get(req.lora_int_id)
        if held is not None and held.request != req:
            raise ValueError(f"lora_int_id {req.lora_int_id} is {held.request.lora_name!r} "
                             f"({held.request.lora_path}); {req.lora_name!r} needs an id of its own")
        if held is None:
            held = load_adapter(req, self.mc, self.max_rank, self.dtype)   # before anything is dropped
            self._make_room()
            self.adapters[req.lora_int_id] = held
            self.loads += 1
        self.adapters.move_to_end(req.lora_int_id)
        self.refs[req.lora_int_id] = self.refs.get(req.lora_int_id, 0) + 1
        return held

    def release(self, lora_int_id: int) -> None:
        n = self.refs.get(lora_int_id, 0) - 1
        if n > 0:
            self.refs[lora_int_id] = n
        else:
            self.refs.pop(lora_int_id, None)

    def _make_room(self) -> None:
        while len(self.adapters) >= self.capacity:
            idle = next((i for i in self.adapters if i not in self.refs), None)
            if idle is None:
                raise AdaptersBusyError(f"lora: all {self.capacity} adapters held (max_loras) are in use by "
                                        "unfinished requests; retry when one finishes, or raise max_loras")
            del self.adapters[idle]
