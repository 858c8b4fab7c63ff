"""vLLM's KV-event wire format, without an engine: a batch our publisher sends decodes with a
strict decoder of vLLM 0.32's own types (written out here as vLLM declares them: every field
without a default required, events tagged by class name), and a bad endpoint is named."""
from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from pagedllm.config import EngineConfig, KVEventsConfig
from pagedllm.engine.kv_events import ZmqEventPublisher
from pagedllm.kv import events as kv


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def publisher(**kw) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", **kw))


def test_a_batch_decodes_with_vllms_types():
    pub = publisher(topic="t", data_parallel_rank=1)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    sub.connect(pub.endpoint)
    time.sleep(0.3)
    big = 2**64 - 5   # xxh3 keys use all 64 bits: msgpack's uint64
    pub.publish([kv.BlockStored([big, 7], None, list(range(32)), 16), kv.BlockRemoved([big]),
                 kv.BlockStored([9], 7, list(range(16)), 16, group_idx=1), kv.AllBlocksCleared()])
    assert sub.poll(5000)
    topic, seq, payload = sub.recv_multipart()
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert topic == b"t" and int.from_bytes(seq, "big") == 0 and batch.data_parallel_rank == 1
    stored, removed, other, cleared = batch.events
    assert stored == BlockStored([big, 7], None, list(range(32)), 16, None, "CPU", None)
    assert removed == BlockRemoved([big], "CPU") and other.group_idx == 1 and other.parent_block_hash == 7
    assert isinstance(cleared, AllBlocksCleared)
    pub.publish([])   # no events, no message
    assert not sub.poll(300)
    sub.close()
    pub.close()


def test_a_busy_endpoint_is_named():
    pub = publisher()
    with pytest.raises(ValueError, match="kv_events_config: endpoint .* cannot be bound"):
        ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=pub.endpoint))
    pub.close()
    with pytest.raises(ValueError, match="topic must be a string"):
        KVEventsConfig(enable_kv_cache_events=True, topic=3)
    for where in ("inproc://kv", "udp://x:1", "5557"):   # inproc publishes inside this process only
        with pytest.raises(ValueError, match="endpoint must be a tcp:// or ipc:// ZMQ endpoint"):
            KVEventsConfig(enable_kv_cache_events=True, endpoint=where)
    with pytest.raises(ValueError, match=r"kv_events_config: unknown keys \['endpoints'\]"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "endpoints": "tcp://*:5557"}')


def test_a_tenants_blocks_are_announced_without_their_tokens():
    from pagedllm.kv import KVCacheManager

    kv = KVCacheManager(16, 4)
    kv.record_events()
    toks = list(range(9))
    for seq, salt in ((0, "tenant-a"), (1, None)):
        h = kv.new_hashes(salt)
        kv.allocate_slots(seq, toks, len(toks), kv.lookup_prefix(toks, h), h)
    salted, plain = kv.take_events()
    assert len(salted.block_hashes) == 2 and salted.token_ids == []
    assert plain.token_ids == toks[:8] and set(plain.block_hashes).isdisjoint(salted.block_hashes)
