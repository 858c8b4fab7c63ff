"""StepController: the visualizer's pause / resume / single step / delay, as the async
engine's step gate (pagedllm.engine.async_engine.StepGate).

The controls are set from the event loop (/viz/control) and read on the engine thread
between steps, so every field sits behind one lock. Between steps it also lets the
VizHub greet new subscribers with their snapshot.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from .hub import VizHub

MAX_STEP_DELAY_S = 10.0


class StepController:
    def __init__(self, hub: VizHub, step_delay: float = 0.0, wake: Callable[[], None] | None = None) -> None:
        self.hub = hub
        # The async engine's wake(): a paused engine idles in a timed wait, and must
        # notice a resume or a single step at once. Bound once the engine exists.
        self.wake = wake or (lambda: None)
        self._lock = threading.Lock()
        self._paused = False
        self._step_budget = 0  # steps still to run while paused
        self._step_delay = step_delay

    # -- controls (any thread) -------------------------------------------------
    @property
    def paused(self) -> bool:
        with self._lock:
            return self._paused

    @property
    def step_delay(self) -> float:
        with self._lock:
            return self._step_delay

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
        self.wake()

    def step_once(self) -> None:
        """While paused: run exactly one more step (once there is work)."""
        with self._lock:
            self._step_budget += 1
        self.wake()

    def set_delay(self, seconds: float) -> None:
        """Sleep this long after each step, so a person can follow the blocks move (the
        page may ask for up to MAX_STEP_DELAY_S; the CLI's --step-delay is not capped)."""
        with self._lock:
            self._step_delay = float(seconds)

    # -- the step gate (engine thread) ------------------------------------------
    def poll(self) -> None:
        self.hub.poll()

    def may_step(self) -> bool:
        with self._lock:
            # A step asked for while running is used up by the next step, as if it were
            # that step: it must not let a later pause run one step on its own.
            if self._paused and not self._step_budget:
                return False
            self._step_budget = max(0, self._step_budget - 1)
            return True

    def after_step(self, stop: threading.Event) -> None:
        delay = self.step_delay
        if delay:
            stop.wait(delay)
