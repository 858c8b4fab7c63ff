"""vLLM's KV events over ZMQ from a real engine (the tiny model): a subscriber that knows
only vLLM's wire format (msgpack decoded to plain maps, read by vLLM's field names) sees
BlockStored for every cached block of a request, chained and carrying its tokens, then
BlockRemoved as the pool evicts them, then AllBlocksCleared on a reset; a late subscriber
gets the missed batches from the replay socket."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.kv.hashing import BlockHashes

B = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [" ".join(f"Item {j}.{i} goes to shelf {i * 7 % 13}." for i in range(20)) for j in range(4)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = LLM(tiny_model, dtype="float32", max_model_len=1024, num_gpu_blocks_override=24,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                                "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})
    yield llm
    llm.close()


def subscribe(endpoint: str, topic: bytes = b"kv") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    time.sleep(0.3)   # ZMQ's slow joiner: a PUB drops what it sends before the subscription arrives
    return sub


def received(sub: zmq.Socket, timeout: float = 5.0) -> list[tuple[int, list]]:
    """(sequence number, decoded batch) for every message until the socket falls quiet."""
    out = []
    while sub.poll(int(timeout * 1000)):
        _, seq, payload = sub.recv_multipart()
        out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        timeout = 0.5
    return out


def events(batches: list[tuple[int, list]]) -> list[dict]:
    return [e for _, batch in batches for e in batch[1]]


def test_stored_then_removed_then_cleared(llm):
    pub = llm.engine.kv_events
    sub = subscribe(pub.endpoint)
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    batches = received(sub)
    assert [s for s, _ in batches] == sorted(s for s, _ in batches), "sequence numbers out of order"
    ts, evs, *rank = batches[0][1]
    assert isinstance(ts, float) and rank in ([], [None])
    stored = [e for e in events(batches) if e["type"] == "BlockStored"]
    assert stored and {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name"} <= set(stored[0])
    # Every full block of prompt + output (all but the last token's, whose KV is never written).
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    want = BlockHashes(B).update(ids[:-1])
    got, parent = [], None
    for e in stored:
        assert e["block_size"] == B and e["medium"] == "CPU"
        assert e["parent_block_hash"] == parent, "a run's parent is the block before it"
        n = len(got)
        assert e["token_ids"] == ids[n * B:(n + len(e["block_hashes"])) * B]
        got += e["block_hashes"]
        parent = got[-1]
    assert got == want

    # Other prompts fill the 24-block pool: the first request's blocks are evicted, announced.
    llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    later = events(received(sub))
    removed = [h for e in later if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert set(want) <= set(removed), "an evicted block was not announced as removed"
    assert all(e["medium"] == "CPU" for e in later if e["type"] == "BlockRemoved")

    llm.reset_prefix_cache()
    assert [e["type"] for e in events(received(sub))] == ["AllBlocksCleared"]
    sub.close()


def test_replay_gives_a_late_subscriber_what_it_missed(llm):
    pub = llm.engine.kv_events
    llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    time.sleep(0.2)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.replay_address)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    seqs = []
    while True:
        assert dealer.poll(5000), "no answer from the replay socket"
        _, topic, seq, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        assert topic == b"kv"
        msgspec.msgpack.decode(payload)
        seqs.append(seq)
    dealer.close()
    assert seqs == list(range(len(seqs))) and len(seqs) >= 3
