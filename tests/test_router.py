"""The data-parallel router (pagedllm.dp.router): plain Python, properties by hypothesis."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.dp.router import (
    PREFIX_BLOCKS,
    HashRing,
    ReplicaLoad,
    Router,
    least_loaded,
    load_bound,
    prefix_key,
)

BLOCK = 16
loads_st = st.lists(st.builds(ReplicaLoad, st.integers(0, 50), st.floats(0, 1), st.booleans()), min_size=1,
                    max_size=8).filter(lambda xs: any(x.alive for x in xs))
prompt_st = st.lists(st.integers(0, 49151), min_size=0, max_size=120)
salt_st = st.none() | st.text(max_size=8)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(0, 2**32))
def test_adding_a_replica_moves_about_one_share_of_keys_and_only_onto_it(n, seed):
    before, after = HashRing(range(n)), HashRing(range(n + 1))
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(3000)]
    moved = [k for k in keys if before.owner(k) != after.owner(k)]
    assert all(after.owner(k) == n for k in moved)  # nothing moves between the old replicas
    share = len(moved) / len(keys)
    assert 0.6 / (n + 1) <= share <= 1.5 / (n + 1)


@settings(max_examples=200, deadline=None)
@given(loads_st, prompt_st, salt_st, st.sampled_from(["prefix", "round-robin", "least-loaded"]))
def test_a_dead_replica_is_never_chosen(loads, ids, salt, policy):
    router = Router(len(loads), policy, BLOCK)
    for _ in range(3):
        assert loads[router.choose(ids, salt, loads)].alive


@settings(max_examples=200, deadline=None)
@given(loads_st, prompt_st, salt_st)
def test_prefix_routing_never_exceeds_the_load_bound(loads, ids, salt):
    """With room in the KV pools, the chosen replica stays within ceil(c x mean) + slack."""
    loads = [ReplicaLoad(x.in_flight, 0.5, x.alive) for x in loads]
    r = Router(len(loads), "prefix", BLOCK).choose(ids, salt, loads)
    assert loads[r].in_flight + 1 <= load_bound(loads)


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 6), st.lists(st.tuples(st.booleans(), st.integers(0, 7)), min_size=1, max_size=200))
def test_bound_holds_over_a_run_of_arrivals_and_finishes(n, ops):
    """Every request of one hot prefix: affinity sends them to one replica until it reaches
    the bound, then they spill; no replica ever passes the bound."""
    router, loads = Router(n, "prefix", BLOCK), [ReplicaLoad() for _ in range(n)]
    hot = list(range(BLOCK * PREFIX_BLOCKS + 5))
    for arrive, which in ops:
        if arrive:
            bound = load_bound(loads)
            r = router.choose(hot, None, loads)
            assert loads[r].in_flight + 1 <= bound
            loads[r].in_flight += 1
        elif loads[which % n].in_flight:
            loads[which % n].in_flight -= 1


def test_affinity_one_prefix_one_replica_when_idle():
    router, loads = Router(4, "prefix", BLOCK), [ReplicaLoad() for _ in range(4)]
    system = list(range(100, 100 + BLOCK * PREFIX_BLOCKS))
    chosen = {router.choose(system + [7, 8, 9] * k, None, loads) for k in range(20)}
    assert len(chosen) == 1


def test_affinity_yields_to_a_full_kv_pool_and_to_load():
    router, loads = Router(2, "prefix", BLOCK), [ReplicaLoad(), ReplicaLoad()]
    ids = list(range(BLOCK * 2))
    home = router.choose(ids, None, loads)
    loads[home].kv_usage = 0.99
    assert router.choose(ids, None, loads) == 1 - home
    loads[home].kv_usage, loads[home].in_flight = 0.1, 10
    assert router.choose(ids, None, loads) == 1 - home


@given(prompt_st, prompt_st, salt_st)
def test_key_reads_the_first_full_blocks_and_the_salt(head, tail, salt):
    if len(head) < BLOCK * PREFIX_BLOCKS:
        head = head + [1] * (BLOCK * PREFIX_BLOCKS - len(head))
    assert prefix_key(head + tail, BLOCK, salt) == prefix_key(head, BLOCK, salt)
    assert prefix_key(head, BLOCK, salt) != prefix_key(head, BLOCK, (salt or "") + "x")
    assert prefix_key(head[:BLOCK - 1], BLOCK, salt) is None  # no full block: nothing to share


def test_a_prompt_without_a_full_block_goes_least_loaded():
    loads = [ReplicaLoad(3), ReplicaLoad(1), ReplicaLoad(0, alive=False), ReplicaLoad(2)]
    assert Router(4, "prefix", BLOCK).choose([1, 2, 3], None, loads) == 1
    assert least_loaded(loads) == 1


def test_round_robin_cycles_over_live_replicas():
    loads = [ReplicaLoad(), ReplicaLoad(alive=False), ReplicaLoad()]
    router = Router(3, "round-robin", BLOCK)
    assert [router.choose([1] * 40, None, loads) for _ in range(4)] == [0, 2, 0, 2]


def test_bad_policy_and_no_live_replica_are_errors():
    with pytest.raises(ValueError, match="router_policy"):
        Router(2, "random")
    with pytest.raises(ValueError, match="no live replica"):
        Router(1).choose([1] * 40, None, [ReplicaLoad(alive=False)])
