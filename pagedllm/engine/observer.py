"""What the engine tells whoever watches it (the visualizer): requests, steps, aborts.

The engine holds a list of observers and calls them on its own thread, only while an
observer says it is `active`: watching costs nothing when nobody watches."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .stats import EngineStats
    from .step_types import SchedulerOutput
    from .sequence import Request, Sequence


class EngineObserver(Protocol):
    active: bool

    def on_request(self, req: Request) -> None:
        """A request was queued."""

    def on_step(self, out: SchedulerOutput, new_tokens: list[tuple[Sequence, int]], view: EngineStats) -> None:
        """A step ran `out` and produced these (sequence, token) pairs; `view` is the
        engine's figures after it (walked: a watcher shows eta), shared with the metrics."""

    def on_abort(self, req: Request) -> None:
        """A request was aborted between steps (its blocks are already freed)."""
