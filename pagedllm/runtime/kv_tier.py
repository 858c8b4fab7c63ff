"""The runner's side of the second tier: a block's bytes out of the KV pools and back in.
The manager decides which blocks move (StepPlan.saves / loads / writes); the store
(kv.tier_store) does the IO on bytes; here the bytes meet the tensors."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..config import EngineConfig
from ..kv.block_store import fingerprint
from ..kv.connector import BlockStore
from ..kv.groups import KVLayout


class BlockBytes:
    """One block id's bytes across every pool that block ids index (each layer's K and V; a
    draft model's pools mirror the target's blocks, so theirs too), in a fixed order."""

    def __init__(self, pools: list[torch.Tensor]) -> None:
        self.pools = pools
        self.sizes = [p[0].numel() * p.element_size() for p in pools]
        self.block_bytes = sum(self.sizes)

    def _rows(self, block_id: int) -> list[torch.Tensor]:
        # A pool's first dimension is the block: its row is contiguous, viewed as bytes.
        return [p[block_id].reshape(-1).view(torch.uint8) for p in self.pools]

    def views(self, block_id: int) -> list:
        """Buffers over the block's bytes, in place on a CPU pool (the block must stay
        unchanged while they are read: the manager pins it); copied to the host on a GPU."""
        return [r.numpy() if r.device.type == "cpu" else r.cpu().numpy() for r in self._rows(block_id)]

    def copies(self, block_id: int) -> list:
        """The block's bytes, copied now (it is about to be reused)."""
        return [r.cpu().numpy().copy() if r.device.type == "cpu" else r.cpu().numpy() for r in self._rows(block_id)]

    def fill(self, block_id: int, payload) -> None:
        """Write a payload of block_bytes into the block."""
        src = torch.frombuffer(payload, dtype=torch.uint8)
        at = 0
        for row, n in zip(self._rows(block_id), self.sizes):
            row.copy_(src[at:at + n], non_blocking=False)
            at += n


class TierIO:
    """Carries out a step's tier IO on the runner's pools."""

    def __init__(self, store: BlockStore, blocks: BlockBytes) -> None:
        self.store = store
        self.blocks = blocks

    def before_forward(self, saves: list[tuple[int, int]], loads: list[tuple[int, object]]) -> None:
        """Saves first (their blocks may be a load's or a copy's destination this step), then loads."""
        for block_id, key in saves:
            self.store.put(key, self.blocks.copies(block_id))
        for block_id, payload in loads:
            self.blocks.fill(block_id, payload)

    def after_forward(self, writes: list[tuple[int, int]]) -> None:
        for block_id, key in writes:
            self.store.put(key, self.blocks.views(block_id))


def model_identity(model_dir: Path) -> str:
    """What names a model's weights for the tier's fingerprint: its directory's name (a
    converted GGUF's carries the file's sha256), its config and its weight files' sizes."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    cfg = model_dir / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    sizes = {p.name: p.stat().st_size for p in sorted(model_dir.glob("*.safetensors"))}
    h.update(json.dumps(sizes, sort_keys=True).encode())
    return f"{model_dir.name}:{h.hexdigest()}"


def kv_fingerprint(model_dir: Path, draft_dir: Path | None, dtype: torch.dtype, kv_dtype: str, block_size: int,
                   backend: str, quantization: str | None, pools: list[torch.Tensor],
                   layout: KVLayout | None = None) -> bytes:
    """The 16 bytes a stored block must carry to be read back here: the same weights (and
    draft), dtype, KV dtype, block size, attention layout, pool shapes and layer groups (which
    layers a block of each group holds in which tensor slot)."""
    shapes = [(tuple(p.shape[1:]), str(p.dtype)) for p in pools]
    if layout is not None and len(layout.groups) > 1:   # one group: the fingerprint earlier runs wrote
        shapes.append(tuple((g.holds, g.window, g.layers) for g in layout.groups))
    return fingerprint(model_identity(model_dir), model_identity(draft_dir) if draft_dir else "", dtype, kv_dtype,
                       block_size, backend, quantization, shapes)


def open_tier(cfg: EngineConfig, model_dir: Path, pools: list[torch.Tensor], draft_dir: Path | None,
              dtype: torch.dtype, kv_dtype: str, backend: str, layout: KVLayout | None = None) -> TierIO:
    """The second tier over these pools (every tensor a block id indexes): on disk at
    --kv-offload-dir, or a shared store at --kv-offload-url, keeping blocks of this engine's
    fingerprint."""
    blocks = BlockBytes(pools)
    fp = kv_fingerprint(model_dir, draft_dir, dtype, kv_dtype, cfg.block_size, backend, cfg.quantization, pools,
                        layout)
    if cfg.kv_offload_url is not None:
        from ..kv.redis_store import RedisStore

        store: BlockStore = RedisStore(cfg.kv_offload_url, fp, blocks.block_bytes)
    else:
        from ..kv.tier_store import TierStore

        store = TierStore(cfg.kv_offload_dir, cfg.kv_offload_size, fp, blocks.block_bytes)
    return TierIO(store, blocks)
