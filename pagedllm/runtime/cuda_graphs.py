"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket
over static input buffers, then replayed. A decode step of a small model is otherwise
dominated by kernel-launch overhead (hundreds of launches per step).

Padding rows (bucket size > live sequences) get slot -1 (no KV write) and context 0
(attention output 0). Decode attention is captured with max_model_len as its bound, so
one graph serves every context length. Needs a backend with decode_graph_metadata
(the Triton one).
"""
from __future__ import annotations

import logging
import time

import torch

from ..attention import AttentionBackend, pad_rows
from ..util import cdiv

logger = logging.getLogger(__name__)

BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]


class DecodeGraphs:
    def __init__(self, model, backend: AttentionBackend, kv_layers: list, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, use_graphs: bool = True) -> None:
        # use_graphs=False runs the same static, padded buffers eagerly: how the CPU tests
        # check the bucketing and padding logic that the graphs replay on a GPU.
        self.use_graphs = use_graphs
        self.model = model
        self.backend = backend
        self.kv_layers = kv_layers
        self.max_model_len = max_model_len
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [next((b for b in BUCKETS if b >= max_num_seqs),
                                                                        max_num_seqs)]
        n = self.buckets[-1]
        max_blocks = cdiv(max_model_len, block_size)
        # ids, positions and slots share one buffer: a step fills all three with one copy.
        self.io = torch.zeros((3, n), dtype=torch.long, device=device)
        self.ids, self.positions, self.slots = self.io
        self.slots.fill_(-1)
        self.tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.ctx = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int):
        return self.backend.decode_graph_metadata(self.slots[:bs], self.tables[:bs], self.ctx[:bs], self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        pool = None
        for bs in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            meta = self._meta(bs)
            self.model(self.ids[:bs], self.positions[:bs], self.kv_layers, meta)  # compiles the kernels
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[bs] = self.model(self.ids[:bs], self.positions[:bs], self.kv_layers, self._meta(bs))
            pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs),
                    self.buckets[0], self.buckets[-1], time.perf_counter() - t0)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            ctx_lens: list[int]) -> torch.Tensor:
        """Hidden states [n, hidden] of n single-token decodes."""
        n = len(ids)
        bs = next(b for b in self.buckets if b >= n)
        pad = bs - n  # padding rows: token 0 at position 0, no slot (-1), context 0
        self.io[:, :bs].copy_(torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad]),
                              non_blocking=True)
        self.ctx[:bs].copy_(torch.tensor(ctx_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        rows = pad_rows(tables, "cpu", torch.int32)
        self.tables[:n, :rows.shape[1]].copy_(rows, non_blocking=True)
        if not self.use_graphs:
            return self.model(self.ids[:bs], self.positions[:bs], self.kv_layers, self._meta(bs))[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
