"""One sequence's logical -> physical block mapping."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..util import cdiv
from .hashing import BlockHashes


@dataclass(slots=True)
class BlockTable:
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    # Tokens that have a slot (KV written, or being written by the current step).
    num_tokens: int = 0
    # The sequence's block keys (shared with its owner, computed once), and how many
    # leading full blocks are registered in the prefix cache under them.
    hashes: BlockHashes | None = None
    num_cached_blocks: int = 0

    def slot(self, j: int) -> int:
        """Physical slot of token j: pid = table[j // B], off = j % B."""
        return self.block_ids[j // self.block_size] * self.block_size + j % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of tokens start..end-1, a run per block (a prefill chunk is thousands)."""
        B, out, j = self.block_size, [], start
        while j < end:
            off = j % B
            n = min(B - off, end - j)
            base = self.block_ids[j // B] * B + off
            out.extend(range(base, base + n))
            j += n
        return out

    @property
    def num_used_blocks(self) -> int:
        """Blocks that hold at least one token: ceil(num_tokens / B)."""
        return cdiv(self.num_tokens, self.block_size)
