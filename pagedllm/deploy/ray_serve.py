"""Engine replicas on Ray Serve (`pagedllm serve --ray --replicas N`), what Ray Serve LLM
does for vLLM: Serve places the replicas, scales them on queue depth, restarts one whose
health check fails or whose actor died; a prefix-aware request router sends a prompt to the
replica that holds its prefix.

Two deployments:
- `Ingress` (one, no CPU of its own): takes every HTTP request, reads the text a prompt
  starts with (a chat's messages, a completion's prompt) and forwards the request, bytes as
  they came, to an engine replica through a streaming DeploymentHandle call;
- `EngineReplica` (N, or min..max autoscaled): one engine and our whole OpenAI server (the
  same FastAPI app `pagedllm serve` runs), driven in process through ASGI; what it streams
  back is the response as the app wrote it, and a header naming the replica.

Routing is Serve's RequestRouter interface with our data-parallel router's policy
(dp.router.Router: chained hashes of the prompt's leading blocks, here of its UTF-8 bytes
in blocks of ROUTE_BLOCK_BYTES, the longest matched run wins under a load bound, new
prefixes spread by a hash ring), each replica holding a slot of the ring while it lives.

Run it:
    pagedllm serve --ray --replicas 2 [--min-replicas 1 --max-replicas 4] [engine and server flags]
or with Serve's own CLI, from a config naming `pagedllm.ray_app:app_builder` and the same flags
as its args (`serve run pagedllm.ray_app:app_builder model=...`).
Every node needs PagedLLM installed and the model at the same path.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..config import EngineConfig
from ..dp.router import ReplicaLoad, Router
from ..server.options import ServerOptions

logger = logging.getLogger(__name__)

ROUTE_BLOCK_BYTES = 64      # a routing block: 64 bytes of the prompt's text (~16 tokens)
MAX_SLOTS = 256             # replicas the router tells apart at once
ROUTE_TEXT_BYTES = 1 << 16  # the prompt's first 64 KiB decide
REPLICA_HEADER = "x-pagedllm-replica"


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One HTTP request, as the ingress forwards it to a replica."""
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    routing_text: str = ""          # what the prompt starts with (the router reads it)
    routing_salt: str | None = None  # the tenant (its API key's digest): records never mix tenants


def routing_text(body: bytes) -> str:
    """The start of a request's prompt: a chat's messages in order, a completion's prompt;
    empty for anything else (routed by load alone)."""
    try:
        data = json.loads(body[:ROUTE_TEXT_BYTES * 4]) if body else None
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("messages"), list):
        parts = []
        for m in data["messages"]:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n")
        return "".join(parts)[:ROUTE_TEXT_BYTES]
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
    if isinstance(prompt, list):
        return " ".join(map(str, prompt))[:ROUTE_TEXT_BYTES]
    return prompt[:ROUTE_TEXT_BYTES] if isinstance(prompt, str) else ""


class PrefixRouter(FIFOMixin, RequestRouter):
    """Serve's request router with dp.router's prefix policy: each live replica holds a slot
    of the router's ring and record; a dead one's slot is forgotten."""

    def initialize_state(self, block_bytes: int = ROUTE_BLOCK_BYTES, max_slots: int = MAX_SLOTS) -> None:
        self.router = Router(max_slots, "prefix", block_size=block_bytes)
        self.slots: dict[ReplicaID, int] = {}
        self.in_flight: dict[ReplicaID, int] = defaultdict(int)
        self.requests: dict[str, ReplicaID] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for rid in [rid for rid in self.slots if rid not in live]:
            self.router.forget(self.slots.pop(rid))
            self.in_flight.pop(rid, None)
        free = (s for s in range(len(self.router.records)) if s not in self.slots.values())
        for r in replicas:
            if r.replica_id not in self.slots:
                self.slots[r.replica_id] = next(free)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        call = pending_request.args[0] if pending_request is not None and pending_request.args else None
        text = getattr(call, "routing_text", "")
        by_slot = {self.slots[r.replica_id]: r for r in candidate_replicas if r.replica_id in self.slots}
        if not by_slot:
            return [candidate_replicas]
        loads = [ReplicaLoad(alive=False) for _ in self.router.records]
        for slot, r in by_slot.items():
            stats = getattr(r, "routing_stats", None) or {}
            loads[slot] = ReplicaLoad(self.in_flight[r.replica_id], float(stats.get("kv_usage", 0.0)))
        slot = self.router.choose(list(text.encode()), getattr(call, "routing_salt", None), loads)
        return [[by_slot[slot]], [r for s, r in by_slot.items() if s != slot]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.in_flight[replica_id] += 1
        self.requests[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.requests.pop(internal_request_id, None) is not None and self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1


class EngineReplica:
    """One engine and its OpenAI app, called through ASGI in this process."""

    def __init__(self, cfg: EngineConfig, opts: ServerOptions) -> None:
        from ..server.launch import build

        logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.built = build(cfg, opts)
        self.app, self.engine = self.built.app, self.built.async_engine
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id if context is not None else str(os.getpid())

    async def handle(self, call: EngineCall):
        """The app's answer: first (status, headers), then the body's chunks as it writes them."""
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
                 "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "query_string": call.query,
                 "root_path": "", "headers": call.headers, "client": ("ray-serve", 0), "server": ("pagedllm", 0)}
        task = asyncio.create_task(self.app(scope, receive, out.put))
        try:
            while True:
                get = asyncio.create_task(out.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    task.result()   # the app ended without an answer: its error
                    return
                msg = get.result()
                if msg["type"] == "http.response.start":
                    yield msg["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg["headers"]] + [
                        (REPLICA_HEADER, self.name)]
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        return
        finally:   # the client went away (the ingress cancelled us): the app sees a disconnect
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5)
                except (asyncio.TimeoutError, Exception):
                    task.cancel()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine can never step again is restarted."""
        from ..engine.core_loop import is_fatal

        err = getattr(self.engine, "error", None)
        if err is not None and is_fatal(err):
            raise RuntimeError(f"the engine failed: {err}")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request router reads of this replica: its KV pool's use."""
        stats = getattr(self.engine, "stats", None)   # the latest figures the engine thread published
        return {"kv_usage": float(stats.kv.usage) if stats is not None else 0.0}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class Ingress:
    """Every HTTP request, forwarded whole to the replica the router picks."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        body = await request.body()
        auth = request.headers.get("authorization")
        call = EngineCall(request.method, request.url.path, request.url.query.encode(), list(request.scope["headers"]),
                          body, routing_text(body),
                          hashlib.sha256(auth.encode()).hexdigest()[:16] if auth else None)
        stream = self.replicas.handle.remote(call)
        status, headers = await stream.__anext__()
        media = dict((k.lower(), v) for k, v in headers).get("content-type", "")
        if "text/event-stream" not in media:
            chunks = [c async for c in stream]
            return Response(b"".join(chunks), status_code=status, headers=_plain(headers))
        return StreamingResponse(stream, status_code=status, headers=_plain(headers))


def _plain(headers: list[tuple[str, str]]) -> dict[str, str]:
    """Response headers for Starlette to send (it sets the length and encoding itself)."""
    return {k: v for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")}


@dataclass(frozen=True)
class ReplicaScaling:
    """How many replicas: fixed (`replicas`), or autoscaled between min and max on the
    requests each replica has in flight (Serve's target_ongoing_requests)."""
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    cpus_per_replica: float = 1.0

    def options(self) -> dict[str, Any]:
        if self.min_replicas is None and self.max_replicas is None:
            if self.replicas < 1:
                raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
            return {"num_replicas": self.replicas}
        low, high = self.min_replicas or 1, self.max_replicas or max(self.min_replicas or 1, self.replicas)
        if not 0 <= low <= high or high < 1:
            raise ValueError(f"--min-replicas {low} and --max-replicas {high}: need 0 <= min <= max, max >= 1")
        return {"autoscaling_config": AutoscalingConfig(min_replicas=low, max_replicas=high,
                                                        initial_replicas=min(max(self.replicas, low), high),
                                                        target_ongoing_requests=self.target_ongoing_requests)}


def application(cfg: EngineConfig, opts: ServerOptions, scaling: ReplicaScaling):
    """The Serve application: the ingress over the engine replicas."""
    replicas = serve.deployment(
        EngineReplica, name="EngineReplica", max_ongoing_requests=max(opts.max_queue_len, 1),
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout,
        ray_actor_options={"num_cpus": scaling.cpus_per_replica},
        request_router_config=RequestRouterConfig(request_router_class=PrefixRouter,
                                                  request_routing_stats_period_s=1.0),
        **scaling.options())
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=max(opts.max_queue_len, 1) * 4)
    return ingress.bind(replicas.bind(cfg, opts))


def server_options(args) -> ServerOptions:
    return ServerOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)})


def scaling_of(args) -> ReplicaScaling:
    return ReplicaScaling(args.replicas, args.min_replicas, args.max_replicas, args.target_ongoing_requests,
                          args.cpus_per_replica)


def run(cfg: EngineConfig, opts: ServerOptions, scaling: ReplicaScaling) -> int:
    """Start (or join, through RAY_ADDRESS) Ray, run the application on opts.host:port, and
    serve until SIGINT or SIGTERM; then the application is deleted."""
    import ray

    app = application(cfg, opts, scaling)
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                 logging_level=logging.WARNING)
    serve.start(http_options={"host": opts.host, "port": opts.port})
    serve.run(app, name="pagedllm", route_prefix="/")
    logger.info("serving on Ray Serve at http://%s:%d: %s", opts.host, opts.port, scaling.options())
    stopping: list[bool] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    while not stopping:
        time.sleep(0.5)
    serve.delete("pagedllm")
    serve.shutdown()
    return 0
