"""Adapters a server serves under their own model names (vLLM's --lora-modules, and its
/v1/load_lora_adapter and /v1/unload_lora_adapter): a request's `model` field picks one; /v1/models
lists them beside the base. Each is read and checked against the base model when it is
registered, so a bad one is refused then (at start: exit 2; at run time: 400), never at a
request. Runtime changes need VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as vLLM does, and the
admin key wherever the server has API keys (an adapter changes what every tenant is served:
with keys and no admin key nobody may change them). The operator's --lora-modules adapters are
pinned: no runtime call unloads them or takes their names."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

from pydantic import BaseModel, Field

from ..lora.adapter import load_adapter
from ..lora.request import LoRARequest

RUNTIME_FLAG = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


# The runtime endpoints' bodies as /openapi.json declares them: the routes read their two
# fields by hand (for OpenAI-shaped errors), so FastAPI would not list them.
class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_FLAG, "").strip().lower() in ("1", "true")


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules entries, vLLM's two forms: name=path, or {"name": ..., "path": ...}."""
    out: list[tuple[str, str]] = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                name, path = d["name"], d["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {item!r} is neither name=path nor "
                                 '{"name": ..., "path": ...}') from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {item!r} is not name=path")
        if not name or not path:
            raise ValueError(f"--lora-modules: {item!r} needs both a name and a path")
        out.append((name, path))
    return out


@dataclass
class ServedLoRAs:
    """Served adapter names -> their requests. `check(req)` reads the adapter against the base
    model (ValueError naming the problem)."""
    base_name: str
    check: object
    enabled: bool

    def __post_init__(self) -> None:
        self.by_name: dict[str, LoRARequest] = {}
        self.pinned: set[str] = set()   # the operator's --lora-modules: never unloaded at run time
        self.unlisted: dict[str, LoRARequest] = {}   # the server's own (private()): never served by name
        self.next_id = 1
        self.lock = threading.Lock()   # loads run off the event loop

    def add(self, name: str, path: str, pinned: bool = False) -> LoRARequest:
        if not self.enabled:
            raise ValueError("adapters need the engine started with --enable-lora")
        with self.lock:
            if name == self.base_name or name in self.by_name:
                raise ValueError(f"the model name {name!r} is already served")
            req = LoRARequest(name, self.next_id, path)
            self.next_id += 1
        self.check(req)
        with self.lock:
            if name in self.by_name:
                raise ValueError(f"the model name {name!r} is already served")
            self.by_name[name] = req
            if pinned:
                self.pinned.add(name)
        return req

    def private(self, name: str, path: str) -> LoRARequest:
        """An adapter the server runs for itself (the visualizer's scenarios), numbered with the
        served ones but served to nobody: no tenant lists it or asks for it by name, so random
        weights never answer a tenant's request. The same one for `name` on every call."""
        if not self.enabled:
            raise ValueError("adapters need the engine started with --enable-lora")
        with self.lock:
            if name in self.unlisted:
                return self.unlisted[name]
            req = LoRARequest(name, self.next_id, path)
            self.next_id += 1
        self.check(req)
        with self.lock:
            return self.unlisted.setdefault(name, req)

    def remove(self, name: str) -> None:
        """KeyError: not served; PermissionError: one of the operator's --lora-modules."""
        with self.lock:
            if name in self.pinned:
                raise PermissionError(name)
            if self.by_name.pop(name, None) is None:
                raise KeyError(name)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.by_name.get(name)


def served_loras(info, base_name: str, modules: list[str] | None) -> ServedLoRAs:
    """The server's adapters, --lora-modules read and checked now."""
    from ..loader import load_config
    from ..models import ModelConfig

    cfg = info.cfg
    if modules and not cfg.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if cfg.enable_lora and cfg.data_parallel_size > 1:
        raise ValueError("--enable-lora with --data-parallel-size > 1 is not supported yet")
    mc = ModelConfig.from_hf(load_config(info.model_dir)) if cfg.enable_lora else None

    def check(req: LoRARequest) -> None:
        import torch

        load_adapter(req, mc, cfg.max_lora_rank, torch.float32)

    served = ServedLoRAs(base_name, check, cfg.enable_lora)
    for name, path in parse_lora_modules(modules):
        served.add(name, path, pinned=True)
    return served
