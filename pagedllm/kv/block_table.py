"""One sequence's logical -> physical block mapping."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..util import cdiv
from .hashing import BlockHashes

# A table entry whose block the sliding window released (or a prefix hit never took): no
# later query of the sequence reads its keys. The numbering stays logical, so token j of a
# block still held is at table[j // B].
RELEASED = -1


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
    # Sliding window: the leading entries that are RELEASED (always a prefix of the table:
    # the window only moves forward). Every later entry holds a block.
    num_released: int = 0

    def slot(self, j: int) -> int:
        """Physical slot of token j: pid = table[j // B], off = j % B."""
        pid = self.block_ids[j // self.block_size]
        if pid == RELEASED:
            raise IndexError(f"token {j}: its block was released by the sliding window")
        return pid * self.block_size + j % self.block_size

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
    def held(self) -> list[int]:
        """The blocks this table holds a reference to, in logical order."""
        return self.block_ids[self.num_released:]

    @property
    def num_used_blocks(self) -> int:
        """Logical blocks that hold at least one token: ceil(num_tokens / B), released ones included."""
        return cdiv(self.num_tokens, self.block_size)

    @property
    def num_held_used_blocks(self) -> int:
        """Blocks still held that hold at least one token."""
        return max(0, self.num_used_blocks - self.num_released)
