"""The data-parallel router (pagedllm.dp.router): plain Python, properties by hypothesis."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.dp.router import (
    MIN_MATCH_FRACTION,
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


# -- affinity on what the replicas hold ----------------------------------------------------
# A chat template's frame around the turns, as SmolLM2's puts it ("<|im_start|>system\n" ...):
# with it, a system prompt of 8 tokens or more fills the first block (3 + 8 + 5 = 16).
HEADER, SEP, FOOTER = [1, 9690, 198], [2, 198, 1, 4093, 198], [2, 198, 1, 520, 9531, 198]
# System prompt lengths in tokens: shorter than one block, between 1 and 4 blocks, past 4.
BANDS = {"under 1 block": (8, 15), "1 to 4 blocks": (17, 63), "over 4 blocks": (65, 200)}


def _chat(system: list[int], user: list[int]) -> list[int]:
    return HEADER + system + SEP + user + FOOTER


def _systems(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    """n system prompts that differ from their first token on."""
    return [[20000 + i] + [rng.randrange(49152) for _ in range(rng.randint(lo, hi) - 1)] for i in range(n)]


def _user(rng: random.Random, longest: int = 40) -> list[int]:
    """A user turn; at most 40 tokens keeps a one-block system prompt at a quarter or more of
    the prompt's blocks (the router counts matches from a fifth on)."""
    return [rng.randrange(49152) for _ in range(rng.randint(1, longest))]


def _homes(router: Router, systems: list[list[int]], chats: int, rng: random.Random, n: int,
           salt: str | None = None, longest: int = 40) -> list[set[int]]:
    """Route `chats` chats behind each system prompt, in random order, one at a time (each
    finished before the next arrives); the replicas each system prompt's chats went to."""
    order = [s for s in range(len(systems)) for _ in range(chats)]
    rng.shuffle(order)
    loads = [ReplicaLoad() for _ in range(n)]
    homes: list[set[int]] = [set() for _ in systems]
    for s in order:
        homes[s].add(router.choose(_chat(systems[s], _user(rng, longest)), salt, loads))
    return homes


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.sampled_from(sorted(BANDS)), st.integers(0, 2**32))
def test_each_system_prompts_chats_go_to_one_replica(n, band, seed):
    """8 system prompts, many user turns behind each: whatever the system prompt's length,
    once it fills a block, its chats all go where its first chat went."""
    rng = random.Random(seed)
    systems = _systems(rng, 8, *BANDS[band])
    homes = _homes(Router(n, "prefix", BLOCK), systems, 12, rng, n)
    assert all(len(h) == 1 for h in homes)


@pytest.mark.parametrize("band", sorted(BANDS))
def test_different_system_prompts_spread_over_replicas(band):
    """New prefixes go by the hash ring: 8 system prompts use 3 or 4 of 4 replicas, and 64
    put between 8 and 24 on each (16 is even)."""
    rng = random.Random(7)
    homes = _homes(Router(4, "prefix", BLOCK), _systems(rng, 8, *BANDS[band]), 6, rng, 4)
    assert len({next(iter(h)) for h in homes}) >= 3
    homes = _homes(Router(4, "prefix", BLOCK), _systems(rng, 64, *BANDS[band]), 2, rng, 4)
    per_replica = [sum(h == {r} for h in homes) for r in range(4)]
    assert all(8 <= k <= 24 for k in per_replica), per_replica


def test_a_prefix_shorter_than_one_block_is_not_held_so_chats_spread():
    """Only full blocks are cached: a shared frame and system prompt of 13 tokens leave every
    chat's first block different, so there is nothing to keep together and they spread."""
    rng = random.Random(3)
    system = [20000, 5, 6, 7, 8]
    router, loads = Router(4, "prefix", BLOCK), [ReplicaLoad() for _ in range(4)]
    chosen = {router.choose(_chat(system, _user(rng)), None, loads) for _ in range(40)}
    assert len(chosen) >= 3


def test_a_preamble_every_system_prompt_opens_with_does_not_pull_them_together():
    """As the bench workload's: 8 system prompts open with the same 2 blocks. The first
    chat of each new one matches those blocks where another was sent; that is too little
    of its prompt to count, so the ring spreads them, and each still keeps together."""
    rng = random.Random(17)
    preamble = [rng.randrange(49152) for _ in range(2 * BLOCK - len(HEADER))]
    systems = [preamble + s for s in _systems(rng, 8, 60, 120)]
    homes = _homes(Router(4, "prefix", BLOCK), systems, 8, rng, 4, longest=200)
    assert all(len(h) == 1 for h in homes)
    assert len({next(iter(h)) for h in homes}) >= 3


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**32),
       st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 99)), min_size=1, max_size=150))
def test_the_longest_match_with_room_wins_and_no_replica_passes_the_bound(n, seed, ops):
    """Chats of 8 system prompts arrive and finish in any order: each goes to a replica
    with room whose record matches the most leading blocks, when that match counts (a
    fifth of the prompt's blocks), never past the load bound."""
    rng = random.Random(seed)
    systems = _systems(rng, 8, 8, 120)
    router, loads = Router(n, "prefix", BLOCK), [ReplicaLoad() for _ in range(n)]
    in_flight: list[int] = []
    for arrive, s, pick in ops:
        if arrive:
            ids = _chat(systems[s], _user(rng, 200))
            bound, matched = load_bound(loads), router.matched(ids)
            best = max(matched[i] for i in range(n) if loads[i].in_flight + 1 <= bound)
            r = router.choose(ids, None, loads)
            assert loads[r].in_flight + 1 <= bound
            if best >= MIN_MATCH_FRACTION * (len(ids) // BLOCK):
                assert matched[r] == best
            loads[r].in_flight += 1
            in_flight.append(r)
        elif in_flight:
            loads[in_flight.pop(pick % len(in_flight))].in_flight -= 1


def test_records_stay_bounded_and_keep_the_hot_prefix():
    """Endless distinct prompts (an attacker's, or just traffic) never grow a record past its
    capacity; a system prompt in use stays matched, because every chat touches it (here
    every 10th request: the 10 between add at most 40 blocks to a record of 64)."""
    rng = random.Random(5)
    router, loads = Router(2, "prefix", BLOCK, record_blocks=64), [ReplicaLoad(), ReplicaLoad()]
    system = _systems(rng, 1, 40, 40)[0]
    home = router.choose(_chat(system, [1]), None, loads)
    for k in range(2000):
        junk = [rng.randrange(49152) for _ in range(BLOCK * rng.randint(1, 4))]
        router.choose(junk, None, loads)
        if k % 10 == 0:
            assert router.choose(_chat(system, _user(rng)), None, loads) == home
        assert all(len(rec) <= 64 for rec in router.records)
    huge = [rng.randrange(49152) for _ in range(BLOCK * 1000)]
    r = router.choose(huge, None, loads)
    assert len(router.records[r]) == 64
    assert router.matched(huge)[r] == 64  # the first blocks are the ones kept


def test_a_dead_replicas_record_is_forgotten():
    rng = random.Random(11)
    router, loads = Router(2, "prefix", BLOCK), [ReplicaLoad(), ReplicaLoad()]
    system = _systems(rng, 1, 30, 30)[0]
    home = router.choose(_chat(system, [1]), None, loads)
    assert router.matched(_chat(system, [2]))[home] > 0
    loads[home].alive = False
    other = router.choose(_chat(system, [3]), None, loads)
    assert other == 1 - home
    router.forget(home)  # the front does this when the process dies; its successor starts empty
    loads[home].alive = True
    assert len(router.records[home]) == 0
    assert {router.choose(_chat(system, _user(rng)), None, loads) for _ in range(10)} == {other}


def test_tenants_salts_do_not_share_records():
    rng = random.Random(13)
    router, loads = Router(4, "prefix", BLOCK), [ReplicaLoad() for _ in range(4)]
    system = _systems(rng, 1, 50, 50)[0]
    for _ in range(5):
        router.choose(_chat(system, _user(rng)), "tenant-a", loads)
    probe = _chat(system, [9, 9])
    assert max(router.matched(probe, "tenant-a")) > 0
    assert router.matched(probe, "tenant-b") == [0] * 4
    assert router.matched(probe, None) == [0] * 4
    # Tenant b's chats keep together on their own record, wherever the ring put the first.
    homes = _homes(router, [system], 10, rng, 4, salt="tenant-b")
    assert len(homes[0]) == 1
