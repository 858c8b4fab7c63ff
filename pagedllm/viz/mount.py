"""The visualizer on a served engine, in the shape the server's launcher takes an
attachment (server/launch.py): the hub watches the engine's steps, the controller gates
them, and the routes mount on the app. The server never imports this; the CLI hands it in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .controller import StepController
from .hub import VizHub
from .routes import add_viz_routes

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.engine import LLMEngine
    from ..server.state import ServerState


@dataclass(eq=False)
class VizMount:
    hub: VizHub
    controller: StepController
    path: str = "/viz/"

    @classmethod
    def on(cls, engine: LLMEngine, step_delay: float = 0.0) -> VizMount:
        """The hub registered as an engine observer, and the controller that gates the
        async engine's steps (pause, single step, delay) for it."""
        hub = VizHub(engine)
        engine.observers.append(hub)
        return cls(hub, StepController(hub, step_delay))

    @property
    def gate(self) -> StepController:
        return self.controller

    def bind(self, async_engine: AsyncLLMEngine) -> None:
        # Both wait on the engine thread's idle wait: a new subscriber or a resume wakes it.
        self.hub.wake = self.controller.wake = async_engine.wake

    def mount(self, app: FastAPI, state: ServerState) -> None:
        add_viz_routes(app, state, self.hub, self.controller)

    def close(self) -> None:
        self.hub.close_all()  # open /viz pages hold event streams: shutdown would wait on them
