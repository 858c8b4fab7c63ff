"""The shared KV tier on a real Redis (Debian's redis-server on a loopback port): a document
prefilled on replica A is served to replica B from the store, with the same greedy tokens;
wrong or missing values are recomputed, never served; a tenant's salt keeps its blocks from
another tenant; a store that goes away costs recomputation, not the engine.

The engines are two LLMs of the tiny model in this process, each its own pool: what two
replicas on two machines are to the store. The TTFT this saves on a real model is measured
by `python -m benchmarks kv_tier --parts redis`, not timed here."""
from __future__ import annotations

import logging
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv.hashing import BlockHashes

from benchmarks.lib.redis_server import RedisServer

B = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)
# ~3k tokens of document, and a question after it.
DOC = " ".join(f"Record {i}: the warehouse in town {i % 17} holds {i * 37 % 101} crates of item {i}." for i in range(120))
QUESTION = "\nQuestion: how many crates does record 42 hold? Answer: record 42 holds"


@pytest.fixture(scope="module")
def redis_server():
    try:
        server = RedisServer(maxmemory="512mb")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield server
    server.stop()


def replica(model: str, url: str) -> LLM:
    return LLM(model, dtype="float32", max_model_len=4096, num_gpu_blocks_override=400, kv_offload_url=url)


def answer(llm: LLM, salt: str | None = None) -> list[int]:
    return llm.generate(DOC + QUESTION, GREEDY, use_tqdm=False, cache_salt=salt)[0].outputs[0].token_ids


def doc_keys(llm: LLM, salt: str | None = None) -> list[int]:
    ids = llm.engine.tokenizer(DOC + QUESTION)["input_ids"]
    return BlockHashes(B, salt).update(ids[:-1])


def tier(llm: LLM):
    return llm.engine.kv.connector


def settle(llm: LLM) -> None:
    """Every block the engine handed its store written, the ones it held back too: write-through
    blocks past the in-flight cap wait in a backlog while the store is behind (a loaded machine's
    writer thread), and idle steps hand them over as the writes finish."""
    for _ in range(1000):
        tier(llm).store.flush()
        if not tier(llm).figures().backlog:
            return
        llm.engine.step()
    raise AssertionError(f"the tier's backlog never drained: {tier(llm).figures()}")


@pytest.fixture(scope="module")
def computed(redis_server, tiny_model):
    """Replica A computes the document (its tier starts empty: the cold answer) and writes it
    through to the store."""
    a = replica(tiny_model, redis_server.url)
    want = answer(a)
    assert tier(a).figures().loaded_blocks == 0
    settle(a)
    a.close()
    return want


def round_trips(client) -> dict[str, int]:
    """Counts of the client's single GETs and of its pipelines sent (one round trip each)."""
    trips = {"get": 0, "pipelines": 0}
    get, pipeline = client.get, client.pipeline

    def one_get(*a, **kw):
        trips["get"] += 1
        return get(*a, **kw)

    def counted_pipeline(*a, **kw):
        p = pipeline(*a, **kw)
        execute = p.execute

        def sent(*a2, **kw2):
            trips["pipelines"] += 1
            return execute(*a2, **kw2)
        p.execute = sent
        return p
    client.get, client.pipeline = one_get, counted_pipeline
    return trips


def test_another_replica_is_served_from_the_store(redis_server, tiny_model, computed):
    b = replica(tiny_model, redis_server.url)
    trips = round_trips(tier(b).store.client)
    assert answer(b) == computed
    keys = doc_keys(b)
    assert len(keys) * B >= 2800
    f = tier(b).figures()
    assert f.loaded_blocks == len(keys), "every full block of the document came from the store"
    assert f.hits == len(keys) * B and f.store.read_failures == 0
    assert b.engine.scheduler.counters.computed_prompt_tokens < 2 * B, "B computed only the question's tail"
    # the lookup and the reads of the hit's 177 blocks (~8 KiB each): pipelined, not a GET a block
    assert trips["get"] == 0 and trips["pipelines"] <= 4, trips
    b.close()


def test_a_hit_read_in_several_pipelines_is_whole(redis_server, tiny_model, computed, monkeypatch):
    from pagedllm.kv import redis_store

    b = replica(tiny_model, redis_server.url)
    monkeypatch.setattr(redis_store, "READ_BATCH_BYTES", 10 * tier(b).store.entry_bytes)
    trips = round_trips(tier(b).store.client)
    assert answer(b) == computed
    n = len(doc_keys(b))
    assert tier(b).figures().loaded_blocks == n and trips["get"] == 0
    assert trips["pipelines"] >= -(-n // 10), "pipelines of 10 blocks each"
    b.close()


def test_wrong_or_missing_values_are_recomputed(redis_server, tiny_model, computed, caplog):
    client = redis_server.client()
    b = replica(tiny_model, redis_server.url)
    store = tier(b).store
    names = [store.name(k) for k in doc_keys(b)]
    value = client.get(names[5])
    flipped = value[:-1] + bytes([value[-1] ^ 1])
    client.set(names[5], flipped)                                   # one bit of the payload flipped
    client.set(names[9], value)                                     # another block's (valid) bytes
    client.set(names[12], value[:100])                              # truncated
    client.delete(names[20])                                        # gone (the server evicted it)
    with caplog.at_level(logging.WARNING, logger="pagedllm.kv.redis_store"):
        assert answer(b) == computed
    # the hit's blocks come in one pipelined read, each checked: every wrong one is caught and
    # deleted at once; the load stops at the first (block 5), and the rest is recomputed
    assert store.snapshot().read_failures == 3
    assert "checksum mismatch" in caplog.text and "holds block" in caplog.text
    assert client.get(names[5]) != flipped, "a wrong value is deleted (and written anew), never served again"
    assert tier(b).figures().loaded_blocks == 5
    b.close()
    # B wrote back what it deleted or found missing and recomputed: the next replica loads it all.
    c = replica(tiny_model, redis_server.url)
    assert answer(c) == computed
    assert tier(c).figures().loaded_blocks == len(names) and tier(c).store.snapshot().read_failures == 0
    c.close()
    client.close()


def test_a_tenant_salt_keeps_its_blocks_to_itself(redis_server, tiny_model, computed):
    a = replica(tiny_model, redis_server.url)
    assert answer(a, salt="tenant-a") == computed
    settle(a)
    a.close()
    b = replica(tiny_model, redis_server.url)
    assert answer(b, salt="tenant-b") == computed
    assert tier(b).figures().loaded_blocks == 0, "another tenant's blocks were served"
    assert answer(b, salt="tenant-a") == computed
    assert tier(b).figures().loaded_blocks == len(doc_keys(b, "tenant-a"))
    b.close()


def test_a_store_that_goes_away_costs_recomputation_only(tiny_model, computed, caplog):
    server = RedisServer(maxmemory="64mb")
    llm = replica(tiny_model, server.url)
    server.stop()
    with caplog.at_level(logging.WARNING, logger="pagedllm.kv"):
        assert answer(llm) == computed
        assert answer(llm) == computed   # the pool's own prefix cache still serves
    assert "served from the pool alone" in caplog.text or "not written" in caplog.text
    llm.close()


def test_bad_urls_are_named(tiny_model):
    with pytest.raises(ValueError, match="kv_offload_url must be a redis"):
        LLM(tiny_model, kv_offload_url="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="cannot reach the store"):
        replica(tiny_model, "redis://127.0.0.1:1")


def test_a_store_that_lost_its_blocks_is_filled_again(tiny_model):
    """A store restarted empty (flushed: what a restart without persistence leaves), or one whose
    keys were evicted, gets the blocks written again when the same prompt is computed again, and
    another replica then hits them: what the engine wrote before is a hint, not the store's word."""
    with RedisServer(maxmemory="256mb") as server:
        a = replica(tiny_model, server.url)
        want = answer(a)
        settle(a)
        keys = doc_keys(a)
        client = server.client()
        names = [tier(a).store.name(k) for k in keys]
        assert client.exists(*names) == len(keys)
        for lose in (client.flushall, lambda: client.delete(*names[::2])):   # an empty restart; evictions
            lose()
            a.reset_prefix_cache()   # the pool forgets too: the prompt is computed again
            assert answer(a) == want
            settle(a)
            assert client.exists(*names) >= 0.9 * len(keys), "written again"
        b = replica(tiny_model, server.url)
        assert answer(b) == want
        assert tier(b).figures().loaded_blocks == len(keys), "the other replica is served from the refilled store"
        a.close()
        b.close()


def test_an_idle_server_hands_over_the_blocks_it_held_back(tiny_model):
    """Write-through blocks past the in-flight cap wait in a backlog while the store is behind; a
    server whose requests are done writes them on its idle loop, so another replica finds them
    without waiting for this one's next request."""
    from pagedllm.engine.async_engine import AsyncLLMEngine

    with RedisServer(maxmemory="256mb") as server:
        a = replica(tiny_model, server.url)
        tier(a).max_inflight = 4   # the store "behind" after 4 blocks: the rest wait
        answer(a)
        tier(a).store.flush()
        held = tier(a).figures().backlog
        assert held > 0
        names = [tier(a).store.name(k) for k in doc_keys(a)]
        client = server.client()
        assert client.exists(*names) < len(names)
        tier(a).max_inflight = 64
        loop = AsyncLLMEngine(a.engine)   # no request: its loop idles
        try:
            deadline = time.monotonic() + 30
            while client.exists(*names) < len(names) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.exists(*names) == len(names), f"{held} held back, {tier(a).figures()}"
        finally:
            loop.shutdown()
            a.close()
