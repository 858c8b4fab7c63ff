"""vLLM's KV events on the wire: the prefix cache's events (kv.events) as msgpack batches
over a ZMQ PUB socket, so that a KV-aware router built for vLLM (llm-d's indexer, Dynamo's
router, vllm-router, or the small subscriber in the docs) routes on our cache unchanged.

The wire is vLLM's (`vllm.distributed.kv_events`, 0.32):
- each step's events are one KVEventBatch [ts, events, data_parallel_rank] (an array), its
  events maps tagged by class name ({"type": "BlockStored", "block_hashes": [...], ...});
- a message is three frames: topic, an 8-byte big-endian sequence number, the payload;
- with a replay_endpoint, a ROUTER socket answers a request [b"", start_seq (8 bytes)] with
  every buffered batch from start_seq on, then a frame of sequence -1.

The engine thread only queues a step's events; one background thread makes them a batch,
encodes it and owns the sockets (ZMQ
sockets are not thread-safe) and sends. A full queue drops the batch with a warning: a slow
subscriber never slows the engine.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from ..config import KVEventsConfig
from ..kv import events as kv

logger = logging.getLogger(__name__)

MEDIUM = "CPU"   # where the pool lives (kv_medium: "GPU" on an accelerator, as vLLM's)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base: tagged with the class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def wire(event: kv.KVEvent, medium: str) -> KVCacheEvent:
    """One event in vLLM's schema (group 0, the full-attention group, leaves group_idx out)."""
    if isinstance(event, kv.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           None, medium, None, event.group_idx or None)
    if isinstance(event, kv.BlockRemoved):
        return BlockRemoved(event.block_hashes, medium, event.group_idx or None)
    return AllBlocksCleared()


class ZmqEventPublisher:
    """PUB (and, optionally, replay ROUTER) sockets on one thread, fed through a queue."""

    def __init__(self, cfg: KVEventsConfig, medium: str = MEDIUM) -> None:
        self.cfg, self.medium = cfg, medium
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context.instance()
        self.dropped = 0
        # Bind here, on the caller's thread, so that a bad or busy endpoint fails the start with
        # its name; the sender thread owns the sockets from then on.
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._bind(self._pub, cfg.endpoint, "endpoint")
        self._replay = None
        if cfg.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._bind(self._replay, cfg.replay_endpoint, "replay_endpoint")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _bind(self, sock: zmq.Socket, endpoint: str, name: str) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise ValueError(f"kv_events_config: {name} {endpoint!r} cannot be bound: {e}") from None

    @property
    def endpoint(self) -> str:
        """Where the PUB socket listens (a port of 0 or * resolved)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_address(self) -> str | None:
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None

    def publish(self, events: Sequence[kv.KVEvent]) -> None:
        """Queue one step's events as a batch (nothing when there are none)."""
        if not events:
            return
        try:   # made into vLLM's structs and encoded on the sender thread, not the engine's
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped, the publisher's queue (%d) is full",
                               self.dropped, self.cfg.max_queue_size)

    def _run(self) -> None:
        topic = self.cfg.topic.encode()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running or not self._queue.empty():
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = None
            if batch is not None:
                ts, events = batch
                payload = self._encoder.encode(KVEventBatch(ts, [wire(e, self.medium) for e in events],
                                                            self.cfg.data_parallel_rank))
                seq = self._seq
                self._seq += 1
                self._buffer.append((seq, payload))
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            if self._replay is not None and poller.poll(0):
                self._answer_replay(topic)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _answer_replay(self, topic: bytes) -> None:
        """[client, b"", start_seq]: every buffered batch from start_seq, then END_SEQ."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored (expected [b'', start_seq])", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Send what is queued, then close the sockets. Idempotent."""
        if self._running:
            self._running = False
            self._thread.join(timeout=5)


def kv_medium(runner: object) -> str:
    """vLLM's medium of the pool a runner holds: GPU on an accelerator, CPU here."""
    device = getattr(runner, "device", None)
    return "CPU" if device is None or getattr(device, "type", "cpu") == "cpu" else "GPU"


def start_publisher(cfg: KVEventsConfig | None, medium: str = MEDIUM) -> ZmqEventPublisher | None:
    return ZmqEventPublisher(cfg, medium) if cfg is not None and cfg.enabled else None
