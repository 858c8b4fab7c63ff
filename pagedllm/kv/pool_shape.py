"""A KV pool's shape (size, block size, policy, its groups' windows): enough to say whether a
request can ever fit it, without a manager. The server of several replicas validates against it."""
from __future__ import annotations

from dataclasses import dataclass

from ..util import cdiv


def window_blocks(window: int, block_size: int, step_tokens: int) -> int:
    """The most blocks one sequence holds at once in a group whose queries see only the last
    `window` keys, when a step gives it slots for at most `step_tokens` tokens: a chunk of
    queries [s, e) reads keys from s - window + 1, so the held range is window - 1 + the
    step's tokens long, one block more where it does not start on a block boundary."""
    return cdiv(window - 1 + step_tokens, block_size) + 1


@dataclass(frozen=True, slots=True)
class PoolShape:
    num_blocks: int
    block_size: int
    policy: str = "paged"
    reserve_blocks: int = 0   # reserve-max: blocks each sequence reserves (max_model_len's)
    # Per layer group (kv.groups): the most blocks one sequence holds at once in a windowed
    # group (window_blocks()); 0 for a group that keeps a block for each of its tokens' blocks.
    window_blocks: tuple[int, ...] = (0,)

    @classmethod
    def of(cls, num_blocks: int, block_size: int, policy: str, max_model_len: int | None,
           window_blocks: tuple[int, ...] = (0,)) -> PoolShape:
        return cls(num_blocks, block_size, policy, cdiv(max_model_len, block_size) if max_model_len else 0,
                   tuple(window_blocks) if policy == "paged" else (0,))

    def blocks_per_seq(self, num_tokens: int) -> int:
        """The most blocks one sequence of num_tokens tokens holds at once, unshared, over its groups."""
        if self.policy == "reserve-max":
            return self.reserve_blocks
        need = cdiv(num_tokens, self.block_size)
        return sum(min(need, w) if w else need for w in self.window_blocks)

    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether num_seqs sequences of num_tokens each fit the empty pool, unshared."""
        return self.blocks_per_seq(num_tokens) * num_seqs <= self.num_blocks
