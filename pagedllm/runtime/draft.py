"""A draft model for speculative decoding: a second, smaller model with the target's
tokenizer proposes k tokens greedily, and the target verifies them in one forward.

Its KV pool mirrors the target's blocks: the same block ids, so one block table (with its
lookahead slots and its rollback) serves both models, and nothing else needs managing.
It proposes after the target's step (runtime/spec_decode.py keeps where each sequence's
draft KV is right): a query catches the draft up on the tokens since, then k - 1 one-token
steps write into the lookahead slots the scheduler holds. A stale or missing draft KV (a
prefix-cache hit made by a request that did not draft) only lowers acceptance: the
target's verification decides."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..attention import AttentionBackend, StepLayout
from ..distributed import TPGroup
from ..kv.block_table import RELEASED
from ..loader import load_config
from ..models import ModelConfig
from .build import build_model
from .host_pages import weights_to_huge_pages
from .kv_cache import allocate_layers, copy_blocks
from .spec_decode import Proposal

logger = logging.getLogger(__name__)


class DraftRunner:
    def __init__(self, model_dir: Path, backend: AttentionBackend, kernels, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        self.cfg = ModelConfig.from_hf(load_config(model_dir))
        backend.check_model(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.model = build_model(model_dir, self.cfg, backend, kernels, TPGroup(), device, dtype, max_model_len)
        self.model.prepack()  # drafts run at a few rows a step, where reordered weights gain most
        weights_to_huge_pages(self.model)   # CPU tensors only
        self.backend, self.device, self.dtype = backend, device, dtype
        self.max_model_len = max_model_len
        self.bytes_per_token = self.cfg.kv_bytes_per_token(backend.kv_dtype_of(dtype))
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        logger.info("draft model %s loaded (%d layers)", model_dir, self.cfg.num_layers)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.layers = allocate_layers(self.cfg, num_blocks, block_size, self.backend.pool_dtype(self.dtype),
                                      self.device, self.backend.cache_shapes)
        self.block_size = block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        copy_blocks(self.layers, pairs)

    @torch.inference_mode()
    def propose(self, work: list[Proposal]) -> dict[int, list[int]]:
        """Greedy drafts after this step's sampling, by seq id. For each sequence: one query
        catches the draft's KV up from `state.valid` to the token just sampled, then one
        query per draft. The KV goes in the sequence's blocks and the lookahead blocks the
        scheduler holds past them, as many drafts as those slots (and max_model_len) allow."""
        B = self.block_size
        runs = []
        for w in work:
            last = len(w.state.tokens) - 1   # the position of the token just sampled
            table = w.chunk.block_ids + w.chunk.lookahead_block_ids
            n = min(w.k, len(table) * B - last, self.max_model_len - last)
            if n > 0:
                runs.append((w.chunk.seq_id, table, n, w.state.tokens,
                             list(range(self._catch_up_from(table, w.state.valid, last), last + 1))))
        if not runs:
            return {}
        drafts: dict[int, list[int]] = {sid: [] for sid, *_ in runs}
        queries = [(table, [tokens[p] for p in pos], pos) for _, table, _, tokens, pos in runs]
        for i in range(max(n for _, _, n, _, _ in runs)):
            live = [(run, q) for run, q in zip(runs, queries) if i < run[2]]
            for (sid, *_), t in zip([r for r, _ in live], self._step([q for _, q in live])):
                drafts[sid].append(t)
            runs = [r for r, _ in live if i + 1 < r[2]]
            queries = [(table, [drafts[sid][-1]], [len(tokens) + i]) for sid, table, _, tokens, _ in runs]
            if not runs:
                break
        return drafts

    def _catch_up_from(self, table: list[int], valid: int, last: int) -> int:
        """The first position to recompute the draft's KV from: where it stops being right,
        but never a query whose window reads a block the target's sliding window released
        (RELEASED entries lead the table; the engine releases blocks only when the draft is
        windowed too). The stale draft KV this skips only lowers acceptance."""
        released = next((i for i, b in enumerate(table) if b != RELEASED), len(table))
        if not released:
            return min(valid, last)
        return min(max(valid, released * self.block_size + self.cfg.kv_window - 1), last)

    def _step(self, queries: list[tuple[list[int], list[int], list[int]]]) -> list[int]:
        """One draft forward: each (block table, token ids, their positions) a query, single
        tokens first (as every backend expects); the argmax after each query's last token,
        in the order given."""
        B = self.block_size
        order = sorted(range(len(queries)), key=lambda j: len(queries[j][1]) != 1)
        ids, positions, slots, q_starts = [], [], [], [0]
        for j in order:
            table, toks, pos = queries[j]
            ids += toks
            positions += pos
            slots += [table[p // B] * B + p % B for p in pos]
            q_starts.append(len(ids))
        nd = sum(1 for _, toks, _ in queries if len(toks) == 1)
        layout = StepLayout(slots, [queries[j][0] for j in order], [queries[j][2][-1] + 1 for j in order],
                            q_starts, nd)
        meta = self.backend.build_metadata(layout, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                            self.layers, meta)
        last = torch.tensor([q - 1 for q in q_starts[1:]], device=hidden.device)
        rows = hidden[last]
        picked = self.model.greedy_tokens(rows)   # the head's argmax kernel, where it has one
        best = (picked if picked is not None else self.model.compute_logits(rows).max(dim=-1).indices).tolist()
        out = [0] * len(queries)
        for rank, j in enumerate(order):
            out[j] = best[rank]
        return out
