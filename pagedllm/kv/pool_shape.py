"""A KV pool's shape (size, block size, policy): enough to say whether a request can ever
fit it, without a manager. The server of several replicas validates against it."""
from __future__ import annotations

from dataclasses import dataclass

from ..util import cdiv


@dataclass(frozen=True, slots=True)
class PoolShape:
    num_blocks: int
    block_size: int
    policy: str = "paged"
    reserve_blocks: int = 0   # reserve-max: blocks each sequence reserves (max_model_len's)

    @classmethod
    def of(cls, num_blocks: int, block_size: int, policy: str, max_model_len: int | None) -> PoolShape:
        return cls(num_blocks, block_size, policy, cdiv(max_model_len, block_size) if max_model_len else 0)

    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether num_seqs sequences of num_tokens each fit the empty pool, unshared."""
        need = self.reserve_blocks if self.policy == "reserve-max" else cdiv(num_tokens, self.block_size)
        return need * num_seqs <= self.num_blocks
