"""VizHub: turns a running LLMEngine into a stream of small JSON messages.

Messages (all plain dicts of ints and short strings, never tensors):
  snapshot  the whole picture: pool (ref counts, cached marks), tables, sequences and
            their token texts, scheduler queues, figures. Sent first to each subscriber.
  request   a request was queued: its sequences and prompt token texts.
  step      one engine step: the KV events it caused (see pagedllm.viz.state), the batch
            (prefill vs decode tokens per sequence), queues, new token texts, figures.
  abort     KV events of requests aborted between steps.

With a second tier (--kv-offload-dir), `cache` and `tier_load` events carry `key`, a
short form of the block's hash: the page follows a block to the tier and back by it (an
`offload` names pool blocks only, and a write-back save names a block already reused).
A snapshot carries `keys` {block: key} of the cached blocks then, and `config.tier`.

Messages also carry `_req_owner` / `_seq_owner` (who sent each request): a server shows
each tenant its own text only (pagedllm.viz.tenancy) and strips these keys.

Engine-side methods run on the engine's thread; a server calls `poll` between steps
(through pagedllm.viz.controller). While nobody subscribes or records,
`active` is False: the engine skips every hook and the KV manager has no listener.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..kv import KVStats
from ..util import cdiv
from .state import kv_picture

if TYPE_CHECKING:
    from ..engine.engine import EngineStats, LLMEngine
    from ..engine.step_types import SchedulerOutput
    from ..engine.sequence import Request, Sequence

# A subscriber this far behind is dropped rather than let the engine's memory grow.
MAX_BACKLOG = 20_000


@dataclass(eq=False)
class Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed: bool = False


class VizHub:
    def __init__(self, engine: LLMEngine, wake: Callable[[], None] | None = None) -> None:
        # The caller registers the hub (engine.observers.append(hub)): who listens to
        # the engine is decided where the engine is built, not by a listener itself.
        self.engine = engine
        self.wake = wake or (lambda: None)
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []
        self._joining: list[Subscriber] = []
        self.recording: list[dict] | None = None
        self.active = False
        self._kv_events: list[dict] = []
        self._t0 = time.time()

    # -- subscribers (any thread) ----------------------------------------------
    def subscribe(self) -> Subscriber:
        """Call from an event loop; the engine thread sends the snapshot at its next turn."""
        sub = Subscriber(asyncio.get_running_loop())
        with self._lock:
            self._joining.append(sub)
        self.wake()
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        sub.closed = True
        self.wake()

    def close_all(self, reason: str = "the server is shutting down") -> None:
        """End every event stream (a server draining its connections must not wait on them)."""
        with self._lock:
            subs, self._subscribers, self._joining = self._subscribers + self._joining, [], []
        for sub in subs:
            self._send(sub, {"kind": "closing", "reason": reason})
            sub.closed = True
        self.wake()

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers) + len(self._joining)

    # -- engine thread -----------------------------------------------------------
    def poll(self) -> None:
        """Between steps: greet new subscribers with a snapshot, forget closed ones,
        and switch the engine hooks on or off."""
        with self._lock:
            joining, self._joining = self._joining, []
            self._subscribers = [s for s in self._subscribers if not s.closed]
        if joining:
            self._set_active(True)
            snap = self.snapshot()
            for sub in joining:
                if not sub.closed:
                    self._send(sub, snap)
            with self._lock:
                self._subscribers += [s for s in joining if not s.closed]
        with self._lock:
            idle = not self._subscribers and not self._joining
        if idle and self.recording is None:
            self._set_active(False)

    def start_recording(self) -> None:
        """Record every message from now on (offline use: same thread as the engine)."""
        self._set_active(True)
        self.recording = [self.snapshot()]

    def stop_recording(self) -> list[dict]:
        trace, self.recording = self.recording or [], None
        self.poll()
        return trace

    def _set_active(self, on: bool) -> None:
        if on != self.active:
            self.active = on
            self._kv_events = []
            self.engine.kv.watch(self._kv_events_append if on else None)

    def _kv_events_append(self, ev: dict) -> None:
        kv = self.engine.kv
        if kv.connector is not None and ev["type"] in KEYED_EVENTS:
            # Read now: the pool holds the block under this hash at the moment it is emitted.
            ev = {**ev, "key": block_key(kv.pool.blocks[ev["block"]].block_hash)}
        self._kv_events.append(ev)

    def _publish(self, msg: dict) -> None:
        if self.recording is not None:
            self.recording.append(msg)
        with self._lock:
            subs = list(self._subscribers)
        for sub in subs:
            self._send(sub, msg)

    def _send(self, sub: Subscriber, msg: dict) -> None:
        if sub.closed:
            return
        if sub.queue.qsize() > MAX_BACKLOG:
            sub.closed = True
            msg = {"kind": "dropped", "reason": f"more than {MAX_BACKLOG} messages behind"}
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, msg)
        except RuntimeError:  # its event loop is gone
            sub.closed = True

    # -- engine hooks (called only while active) ---------------------------------
    def on_request(self, req: Request) -> None:
        self._publish({"kind": "request", "t": self._now(), "req": req.request_id,
                       "seqs": [s.seq_id for s in req.seqs], "n": len(req.seqs),
                       "max_tokens": req.max_tokens, "prompt": self._pieces(req.prompt_token_ids),
                       **_owners([req])})

    def on_step(self, out: SchedulerOutput, new_tokens: list[tuple[Sequence, int]], view: EngineStats) -> None:
        tokens: dict[int, list[str]] = {}
        for seq, tok in new_tokens:
            tokens.setdefault(seq.seq_id, []).append(self._piece(tok))
        kv_events, self._kv_events = self._kv_events, []
        self._publish({
            "kind": "step", "t": self._now(), "step": self.engine.steps, "kv": kv_events,
            "batch": [[s.seq.seq_id, s.start, s.num_tokens, s.num_draft] for s in out.scheduled],
            "prefill_tokens": out.num_prefill_tokens, "decode_tokens": out.num_decode_tokens,
            "preempted": [s.seq_id for s in out.preempted], "tokens": tokens,
            # Sequences that ended this step: those that got a token, and beams pruned without one.
            "finished": {s.seq_id: s.finish_reason for s in [seq for seq, _ in new_tokens] +
                         [x.seq for x in out.scheduled] if s.finish_reason},
            **self._queues(), "figures": self.figures(view),
            **_owners({seq.request for seq, _ in new_tokens})})

    def on_abort(self, req: Request) -> None:
        kv_events, self._kv_events = self._kv_events, []
        self._publish({"kind": "abort", "t": self._now(), "req": req.request_id, "kv": kv_events,
                       "finished": {s.seq_id: "abort" for s in req.seqs}, **self._queues(),
                       "figures": self.figures(), **_owners([req])})

    # -- pictures ------------------------------------------------------------------
    def snapshot(self) -> dict:
        eng = self.engine
        seqs = {}
        for req in eng.requests.values():
            for s in req.seqs:
                seqs[s.seq_id] = {"req": req.request_id, "index": s.index, "status": s.status.name.lower(),
                                  "tokens": self._pieces(s.token_ids)}
        return {"kind": "snapshot", "t": self._now(), "step": eng.steps, "config": self.config(),
                **kv_picture(eng.kv), **tier_keys(eng.kv), "seqs": seqs,
                "requests": {rid: {"seqs": [s.seq_id for s in r.seqs], "n": len(r.seqs),
                                   "max_tokens": r.max_tokens} for rid, r in eng.requests.items()},
                **self._queues(), "figures": self.figures(), **_owners(eng.requests.values())}

    def config(self) -> dict:
        eng = self.engine
        return {"num_blocks": eng.kv.pool.num_blocks, "block_size": eng.kv.block_size,
                "policy": eng.kv.policy, "prefix_caching": eng.kv.enable_prefix_caching,
                "sliding_window": max(g.window for g in eng.kv.groups), "windows": [g.window for g in eng.kv.groups],
                "tier": tier_config(eng), "lora": bool(eng.cfg.enable_lora),
                "max_num_seqs": eng.scheduler.max_num_seqs, "max_model_len": eng.max_model_len,
                "model": eng.model_name}

    def figures(self, view: EngineStats | None = None) -> dict:
        """The live figures, from the step's read-only view (the engine's own figures of
        that step, walked once for every reader), or from the engine now."""
        eng = self.engine
        view = view or eng.stats()
        # The traditional scheme reserves max length (prompt + max_tokens) per running sequence.
        reserve = sum(cdiv(min(len(s.request.prompt_token_ids) + s.request.max_tokens, eng.max_model_len),
                           eng.kv.block_size) for s in eng.scheduler.running)
        figs = kv_figures(view.kv, reserve, view.preemptions)
        if view.spec is not None:
            figs.update(spec_drafted=view.spec.num_draft_tokens, spec_accepted=view.spec.num_accepted_tokens)
        return figs

    def _queues(self) -> dict:
        sch = self.engine.scheduler
        return {"running": [s.seq_id for s in sch.running], "waiting": [s.seq_id for s in sch.waiting]}

    def _pieces(self, ids: list[int]) -> list[str]:
        return self.engine.tokenizer.batch_decode([[t] for t in ids]) if ids else []

    def _piece(self, tok: int) -> str:
        return self.engine.tokenizer.decode([tok])

    def _now(self) -> float:
        return round(time.time() - self._t0, 4)


def _owners(reqs) -> dict:
    """Who owns what a message names, for the per-tenant view (pagedllm.viz.tenancy):
    the owner of each request and sequence, and a stand-in id that names no request."""
    reqs = list(reqs)
    return {"_req_owner": {r.request_id: [r.owner, f"request {r.seqs[0].seq_id}"] for r in reqs if r.seqs},
            "_seq_owner": {s.seq_id: r.owner for r in reqs for s in r.seqs}}


# KV events naming one block that the pool holds under a hash as they are emitted.
KEYED_EVENTS = ("cache", "tier_load")


def block_key(block_hash: int | None) -> str | None:
    """A block's hash as the page names tier entries: 12 hex digits (a JSON number would lose
    a 64-bit hash's low bits in JavaScript; 48 bits tell a page's few thousand blocks apart)."""
    return None if block_hash is None else f"{block_hash & 0xFFFF_FFFF_FFFF:012x}"


def tier_keys(kv) -> dict:
    """A snapshot's keys of the cached blocks, with a tier (none without: nothing to follow)."""
    if kv.connector is None:
        return {}
    return {"keys": {b.block_id: block_key(b.block_hash) for b in kv.pool.blocks if b.block_hash is not None}}


def tier_config(eng: LLMEngine) -> dict | None:
    """What the page says of the second tier (never its folder: a tenant need not see the server's paths)."""
    if eng.kv.connector is None:
        return None
    return {"write_policy": eng.cfg.kv_offload_write_policy, "preemption_mode": eng.cfg.preemption_mode}


def tier_figures(st: KVStats) -> dict:
    """The second tier's figures (none without a tier: the page then hides its panel)."""
    t = st.tier
    if t is None:
        return {}
    d = t.store
    return {"tier_hits": t.hits, "tier_hit_rate": round(st.tier_hit_rate, 4),
            "tier_loaded": t.loaded_blocks, "tier_offloaded": t.offloaded_blocks,
            "tier_backlog": t.backlog, "swap_outs": t.swap_outs, "swap_out_blocks": t.swap_out_blocks,
            "tier_blocks": d.blocks, "tier_bytes": d.bytes, "tier_capacity": d.capacity_bytes,
            "tier_written": d.written_blocks, "tier_evicted": d.evicted_blocks, "tier_read": d.read_blocks,
            "tier_read_failures": d.read_failures, "tier_write_errors": d.write_errors}


def kv_figures(st: KVStats, reserve_max_blocks: int, preemptions: int = 0) -> dict:
    """The live figures: U_kv, H, eta, and blocks used against no sharing and reserve-max
    (`st`: a walked KVStats, as KVCacheManager.stats() gives), and the tier's if any."""
    figs = {"used": st.used_blocks, "shared": st.pool.shared_blocks,
            "cached_free": st.cached_free_blocks, "free": st.free_blocks, "usage": round(st.usage, 4),
            "hit_rate": round(st.hit_rate, 4), "waste": round(st.waste, 4),
            "without_sharing": st.blocks_without_sharing, "reserve_max": reserve_max_blocks,
            "cow": st.cow_copies, "forks": st.forks, "evictions": st.pool.evictions, "preemptions": preemptions,
            "window_released": st.window_released, **tier_figures(st)}
    if len(st.groups) > 1:   # a model whose layers mix attention types: what each layer group holds
        figs["groups"] = [{"kind": g.kind, "held": g.held_blocks, "released": g.released} for g in st.groups]
    return figs
