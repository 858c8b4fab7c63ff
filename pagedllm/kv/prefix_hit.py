"""A prefix hit across the KV cache's layer groups."""
from __future__ import annotations

from typing import Sequence


class PrefixHit(list):
    """A prefix hit: group 0's blocks (a list, as a one-group model's hit always was) and,
    in `per_group`, every group's blocks of the same prefix (RELEASED where a window group
    needs no block)."""
    __slots__ = ("per_group",)

    def __init__(self, per_group: Sequence[Sequence[int]]) -> None:
        super().__init__(per_group[0])
        self.per_group = [list(g) for g in per_group]

    def cut(self, num_blocks: int) -> PrefixHit:
        return PrefixHit([g[:num_blocks] for g in self.per_group])
