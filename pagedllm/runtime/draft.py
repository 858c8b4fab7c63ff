"""A draft model for speculative decoding: a second, smaller model with the target's
tokenizer proposes k tokens greedily, and the target verifies them in one forward.

Its KV pool mirrors the target's blocks: the same block ids, so one block table (with its
lookahead slots and its rollback) serves both models, and nothing else needs managing.
A sequence's draft KV is right below `draft_from` (the scheduler keeps it: verification
and preemption move it); each proposal first catches the draft up on the tokens since,
then runs k - 1 one-token steps. A stale or missing draft KV (a prefix-cache hit made by a
request that did not draft) only lowers acceptance: the target's verification decides."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..attention import AttentionBackend, StepLayout
from ..distributed import TPGroup
from ..loader import load_config
from ..models import ModelConfig
from ..plan import ChunkPlan
from .kv_cache import allocate_layers, copy_blocks

logger = logging.getLogger(__name__)


class DraftRunner:
    def __init__(self, model_dir: Path, backend: AttentionBackend, kernels, device: torch.device,
                 dtype: torch.dtype) -> None:
        from .model_runner import build_model

        self.cfg = ModelConfig.from_hf(load_config(model_dir))
        backend.check_model(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.model = build_model(model_dir, self.cfg, backend, kernels, TPGroup(), device, dtype)
        self.backend, self.device, self.dtype = backend, device, dtype
        self.bytes_per_token = self.cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        logger.info("draft model %s loaded (%d layers)", model_dir, self.cfg.num_layers)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.layers = allocate_layers(self.cfg, num_blocks, block_size, self.dtype, self.device,
                                      self.backend.cache_shapes)
        self.block_size = block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        copy_blocks(self.layers, pairs)

    def _slot(self, c: ChunkPlan, pos: int) -> int:
        B = self.block_size
        return c.block_ids[pos // B] * B + pos % B

    @torch.inference_mode()
    def propose(self, chunks: list[ChunkPlan]) -> None:
        """Fill the draft of every chunk that asks the runner for one (draft_from >= 0): its
        placeholder tokens become the draft model's greedy tokens, in c.draft and at the end
        of c.token_ids."""
        work = [c for c in chunks if c.draft_from >= 0 and c.draft]
        if not work:
            return
        # The catch-up: positions draft_from .. start (the real last token), one query each.
        # Single-token queries first, as every backend expects.
        work.sort(key=lambda c: c.start + 1 - c.draft_from != 1)
        runs = [(c, list(range(min(c.draft_from, c.start), c.start + 1))) for c in work]
        tokens = self._step([(c, c.context[p0[0]:p0[-1] + 1], p0) for c, p0 in runs])
        for i in range(max(len(c.draft) for c in work)):
            for c, t in zip(work, tokens):
                if i < len(c.draft):
                    c.draft[i] = t
                    c.token_ids[len(c.token_ids) - len(c.draft) + i] = t
            nxt = [c for c in work if i + 1 < len(c.draft)]
            if not nxt:
                break
            work = nxt
            tokens = self._step([(c, [c.draft[i]], [c.start + 1 + i]) for c in work])

    def _step(self, queries: list[tuple[ChunkPlan, list[int], list[int]]]) -> list[int]:
        """One draft forward: each (chunk, token ids, their positions) a query; the argmax
        after each query's last token."""
        ids, positions, slots, q_starts = [], [], [], [0]
        for c, toks, pos in queries:
            ids += toks
            positions += pos
            slots += [self._slot(c, p) for p in pos]
            q_starts.append(len(ids))
        nd = sum(1 for _, toks, _ in queries if len(toks) == 1)
        layout = StepLayout(slots, [c.block_ids for c, _, _ in queries], [pos[-1] + 1 for _, _, pos in queries],
                            q_starts, nd)
        meta = self.backend.build_metadata(layout, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                            self.layers, meta)
        last = torch.tensor([q - 1 for q in q_starts[1:]], device=hidden.device)
        return self.model.compute_logits(hidden[last]).max(dim=-1).indices.tolist()
