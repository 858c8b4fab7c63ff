"""Stored responses (server/responses/store.py): records counted whole, each tenant within its caps
oldest first, the total within its own without one tenant evicting another's, and a refused
store said so."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagedllm.server.responses.store import ResponseStore, StoredResponse


def record(i: int, pad: int) -> StoredResponse:
    response = {"id": f"resp_{i}", "metadata": {"k": "v"}, "instructions": "x" * pad, "tools": [], "output": []}
    return StoredResponse.of(response, [{"role": "user", "content": "hi"}])


def test_a_record_is_counted_whole():
    small, big = record(0, 0), record(1, 100_000)
    assert big.nbytes - small.nbytes == 100_000   # instructions, metadata, tools: all of it counts


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3000)), max_size=60),
       per=st.integers(1, 8), cap=st.integers(2000, 8000), total=st.integers(3000, 12000))
def test_caps_hold_and_no_tenant_evicts_another(ops, per, cap, total):
    store = ResponseStore(per, bytes_per_tenant=cap, bytes_total=total)
    held: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    for i, (tenant, pad) in enumerate(ops):
        others = {t: list(ids) for t, ids in held.items() if t != tenant}
        rec = record(i, pad)
        kept = store.put(tenant, rec.response["id"], rec)
        held = {t: [rid for rid in ids if store.get(t, rid) is not None] for t, ids in held.items()}
        if kept:
            held[tenant].append(rec.response["id"])
        else:
            assert store.get(tenant, rec.response["id"]) is None
        assert {t: ids for t, ids in held.items() if t != tenant} == others   # nobody else lost anything
        for t in held:
            assert len(held[t]) <= per and store.bytes_held(t) <= cap
            assert store.bytes_held(t) == sum(store.get(t, rid).nbytes for rid in held[t])
        assert store.bytes_held(everyone=True) <= total
        if kept:   # its own oldest went first: what it keeps is its newest, in order
            assert held[tenant] == [f"resp_{j}" for j in range(i + 1) if f"resp_{j}" in held[tenant]]


def test_a_full_store_refuses_instead_of_evicting_another_tenant():
    store = ResponseStore(100, bytes_per_tenant=10_000, bytes_total=12_000)
    assert store.put("a", "resp_0", record(0, 9000))
    assert not store.put("b", "resp_1", record(1, 5000))   # the total is a's: b is refused
    assert store.get("a", "resp_0") is not None
    assert store.put("b", "resp_2", record(2, 1000))       # what fits is kept
    assert not store.put("b", "resp_3", record(3, 5000))   # refused: b's own records are not dropped for nothing
    assert store.get("b", "resp_2") is not None
    assert store.delete("a", "resp_0") and store.put("b", "resp_1", record(1, 5000))
