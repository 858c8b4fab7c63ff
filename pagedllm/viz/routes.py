"""The visualizer's HTTP side: the page at /viz/, its SSE event stream, engine controls,
a consistent state read, and the built-in scenarios (as traces, or run on the live engine)."""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import Counter
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from ..server.shared_read import SharedRead
from ..server.state import APIError, ServerState
from .controller import MAX_STEP_DELAY_S, StepController
from .hub import VizHub
from .scenarios import SCENARIOS, Scenario, prompt_text, trace_path, write_adapters
from .state import kv_picture
from .tenancy import EVERYTHING, view

logger = logging.getLogger(__name__)
# index.html sits beside static/, so the page also opens from disk (file://) for replays.
PAGE = Path(__file__).parent / "index.html"
STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0
MAX_WATCHERS_PER_TENANT = 4
STATE_TTL_S = 0.25


def add_viz_routes(app: FastAPI, state: ServerState, hub: VizHub, controller: StepController) -> None:
    """Mount the visualizer on a server's app: the page, its event stream, a state read,
    the engine controls and the scenarios."""
    _add_page_routes(app, state)
    _add_event_route(app, state, hub)
    _add_state_route(app, state, hub, controller)
    _add_control_route(app, state, controller)
    _add_scenario_routes(app, state)


def _check_key(state: ServerState, request: Request) -> str | None:
    # EventSource cannot send headers, hence ?api_key=.
    return state.authenticate(request, query_key=True)


def _check_control(state: ServerState, request: Request) -> None:
    if not state.may_control(_check_key(state, request)):
        raise APIError(403, "engine controls need the admin key (--admin-key): they would slow every tenant",
                       "permission_error")


def _add_page_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/viz", include_in_schema=False)
    async def viz_redirect(request: Request):
        q = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"/viz/{q}")

    @app.get("/viz/", include_in_schema=False)
    async def viz_page(request: Request):
        _check_key(state, request)
        return FileResponse(PAGE)

    app.mount("/viz/static", StaticFiles(directory=STATIC), name="viz-static")


def _add_event_route(app: FastAPI, state: ServerState, hub: VizHub) -> None:
    watchers: Counter = Counter()

    @app.get("/viz/events")
    async def viz_events(request: Request):
        """Server-sent events: a snapshot, then one message per engine step."""
        key = _check_key(state, request)
        who = EVERYTHING if state.is_admin(key) else state.tenant(key)
        if watchers[who] >= MAX_WATCHERS_PER_TENANT:
            raise APIError(429, f"at most {MAX_WATCHERS_PER_TENANT} visualizer streams per API key", "rate_limit_error")
        watchers[who] += 1
        sub = hub.subscribe()

        async def stream():
            try:
                while True:
                    try:
                        msg = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    yield f"data: {json.dumps(view(msg, who), separators=(',', ':'))}\n\n"
                    if msg.get("kind") in ("dropped", "closing"):
                        return
            finally:
                hub.unsubscribe(sub)
                watchers[who] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _add_state_route(app: FastAPI, state: ServerState, hub: VizHub, controller: StepController) -> None:
    def read(engine):
        return {"step": engine.steps, "config": hub.config(), "figures": hub.figures(),
                "tables": kv_picture(engine.kv)["tables"],
                "paused": controller.paused, "step_delay": controller.step_delay,
                "subscribers": hub.num_subscribers}
    shared = SharedRead(lambda: state.engine.call(read), STATE_TTL_S)

    @app.get("/viz/state")
    async def viz_state(request: Request):
        """The manager's own figures, read on the engine thread between two steps (block
        tables and counts only: no text). Reads within STATE_TTL_S share one engine call,
        so polling it cannot slow the engine for others."""
        _check_key(state, request)
        return await shared()


def _add_control_route(app: FastAPI, state: ServerState, controller: StepController) -> None:
    @app.post("/viz/control")
    async def viz_control(request: Request):
        """{"action": "pause" | "resume" | "step" | "delay", "seconds": s}"""
        _check_control(state, request)
        body = await state.read_json(request)
        action = body.get("action") if isinstance(body, dict) else None
        if action == "pause":
            controller.pause()
        elif action == "resume":
            controller.resume()
        elif action == "step":
            controller.step_once()
        elif action == "delay":
            s = body.get("seconds")
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not 0 <= s <= MAX_STEP_DELAY_S:
                raise APIError(400, f"seconds: must be a number in [0, {MAX_STEP_DELAY_S:g}]", param="seconds")
            controller.set_delay(float(s))
        else:
            raise APIError(400, "action: must be one of pause, resume, step, delay", param="action")
        return {"paused": controller.paused, "step_delay": controller.step_delay}


def _add_scenario_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/viz/scenarios")
    async def viz_scenarios(request: Request):
        _check_key(state, request)
        return [{"name": s.name, "title": s.title, "description": s.description,
                 "trace": trace_path(s.name).exists(), "live": bool(s.requests)} for s in SCENARIOS.values()]

    @app.post("/viz/scenarios/{name}/run")
    async def viz_run(name: str, request: Request):
        """Send a scenario's requests to the live engine (in the background)."""
        _check_control(state, request)
        sc = SCENARIOS.get(name)
        if sc is None or not sc.requests:
            live = [s.name for s in SCENARIOS.values() if s.requests]
            raise APIError(404, f"no live scenario {name!r}; live ones: {', '.join(live)}", "NotFoundError", "name")
        if sc.adapters and not state.loras.enabled:
            raise APIError(400, f"scenario {name!r} runs LoRA adapters: this engine was started without "
                           f"--enable-lora (`pagedllm viz --scenario {name}` starts one with it)", param="name")
        task = asyncio.get_running_loop().create_task(run_scenario(state, name))
        _background.add(task)
        task.add_done_callback(_background.discard)
        return JSONResponse({"scenario": name, "requests": len(sc.requests)}, status_code=202)


_background: set[asyncio.Task] = set()
_runs = itertools.count()


async def run_scenario(state: ServerState, name: str) -> None:
    """Queue a scenario's requests on the live engine, each once the engine has run its
    `at_step` steps since the scenario started, and drain their outputs."""
    sc = SCENARIOS[name]
    eng = state.engine
    adapters = await _served_adapters(state, sc)
    start, run = eng.stats.steps, next(_runs)

    async def one(i: int, r) -> None:
        idle_since = None
        while eng.stats.steps - start < r.at_step and eng.alive:
            # Arrivals count engine steps; if the engine goes idle first, do not wait forever.
            busy = eng.stats.num_running or eng.stats.num_waiting
            idle_since = None if busy else (idle_since or time.monotonic())
            if idle_since and time.monotonic() - idle_since > 1.0:
                break
            await asyncio.sleep(0.05)
        try:
            # Token ids as the chat template wrote them: no second BOS.
            ids = state.tokenizer.encode(prompt_text(state.tokenizer, r), add_special_tokens=False)
            lora = adapters[r.adapter] if r.adapter else None
            async for _ in eng.submit(f"viz-{name}-{run}-{i}", ids, r.sampling(), lora_request=lora):
                pass
        except Exception as e:  # a scenario request failing must not take the server down
            logger.warning("scenario %s request %d failed: %s", name, i, e)

    await asyncio.gather(*(one(i, r) for i, r in enumerate(sc.requests)))


async def _served_adapters(state: ServerState, sc: Scenario) -> dict:
    """The scenario's adapters on this server: written (random weights, into a folder kept for the
    server's life) on the first run and run as the server's own (ServedLoRAs.private: no tenant is
    served them), the same ones on every run after. ValueError where the engine serves no adapters."""
    if not sc.adapters:
        return {}
    if any(n not in state.loras.unlisted for n in sc.adapters):
        await asyncio.to_thread(_write_and_serve, state, sc)
    return {n: state.loras.unlisted[n] for n in sc.adapters}


def _write_and_serve(state: ServerState, sc: Scenario) -> None:
    import atexit
    import shutil
    import tempfile

    from ..loader import load_config
    from ..models import ModelConfig

    mc = ModelConfig.from_hf(load_config(state.engine.info.model_dir))
    folder = Path(tempfile.mkdtemp(prefix=f"pagedllm-viz-{sc.name}-"))
    atexit.register(shutil.rmtree, folder, True)

    write_adapters(sc, mc, folder, lambda name, path, i: state.loras.private(name, path))
