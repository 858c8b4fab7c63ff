"""Scheduler on the real KVCacheManager and real Sequence/Request objects, no model:
admission order, the max_num_seqs cap, the per-step token budget (chunked prefill),
the preemption victim, and requests that can never fit the pool."""
from __future__ import annotations

import itertools

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.queue_policy import LongestPrefixMatch, make_policy
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Request, Sequence, SeqStatus
from pagedllm.engine.step_update import StepApplier
from pagedllm.engine.stops import StopRules
from pagedllm.engine.tier_loads import TierLoads
from pagedllm.kv import KVCacheManager
from pagedllm.plan import StepResult
from pagedllm.sampling_params import SamplingParams

B = 16
_ids = itertools.count(1)


def make_seq(sched: Scheduler, prompt_len: int, max_tokens: int = 8, priority: int = 0) -> Sequence:
    sid = next(_ids)
    prompt = [(sid * 7 + i) % 1000 + 1 for i in range(prompt_len)]
    req = Request(f"r{sid}", None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens,
                  priority=priority)
    seq = Sequence(sid, req, 0, list(prompt), prompt_len, seed=0, status=SeqStatus.PENDING)
    req.seqs.append(seq)
    sched.add(seq)
    return seq


def step(sched: Scheduler, out) -> None:
    """What the engine does after the forward: sample a token for each row that asks."""
    StepApplier(sched, StopRules(frozenset(), 1 << 20)).apply(
        out, StepResult(tokens={t.seq_id: 5 for s in out.scheduled for t in s.sample_for}))
    sched.kv.check_integrity()


def rows(out) -> list[tuple[Sequence, int]]:
    return [(s.seq, s.num_tokens) for s in out.scheduled]


def test_admission_in_arrival_order_and_max_num_seqs_cap():
    kv = KVCacheManager(64, B, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=1000)
    a, b, c = (make_seq(sched, n) for n in (5, 7, 9))
    out = sched.schedule()
    assert rows(out) == [(a, 5), (b, 7)]
    assert list(sched.waiting) == [c] and c.status is SeqStatus.WAITING
    assert sched.running == [a, b]
    assert kv.tables.keys() == {a.seq_id, b.seq_id}
    step(sched, out)

    out = sched.schedule()   # both decode; the cap still keeps c out
    assert rows(out) == [(a, 1), (b, 1)] and out.num_decode_tokens == 2
    assert list(sched.waiting) == [c]
    step(sched, out)

    sched.finish(a, "length")
    assert a.seq_id not in kv.tables
    out = sched.schedule()   # a seat is free: c is admitted behind b's decode
    assert rows(out) == [(b, 1), (c, 9)]
    assert not sched.waiting and sched.running == [b, c]


def test_token_budget_chunked_prefill_and_partial_prefill_slots():
    kv = KVCacheManager(64, B, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=64,
                      long_prefill_token_threshold=32, max_num_partial_prefills=1)
    d = make_seq(sched, 5)
    step(sched, sched.schedule())             # d is now decoding
    long1, long2, short = make_seq(sched, 100), make_seq(sched, 100), make_seq(sched, 10)

    out = sched.schedule()
    # d keeps its one token; long1's chunk is capped by the threshold; long2 (also long)
    # waits for the single partial-prefill slot; short is admitted past it.
    assert rows(out) == [(d, 1), (long1, 32), (short, 10)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 42
    assert out.num_tokens <= 64
    assert list(sched.waiting) == [long2] and long2.seq_id not in kv.tables
    assert [s.sample_for for s in out.scheduled] == [[d], [], [short]]
    step(sched, out)
    assert long1.num_computed_tokens == 32 and len(long1.token_ids) == 100

    out = sched.schedule()   # long1 still holds the slot: long2 still waits
    assert rows(out) == [(d, 1), (long1, 32), (short, 1)]
    assert list(sched.waiting) == [long2]
    step(sched, out)

    out = sched.schedule()   # long1's last 36 tokens: still long (> 32), one more 32 chunk
    assert rows(out) == [(d, 1), (long1, 32), (short, 1)]
    step(sched, out)
    out = sched.schedule()   # 4 left: long1 is no longer long, so long2 gets the slot
    assert rows(out) == [(d, 1), (long1, 4), (short, 1), (long2, 32)]
    assert not sched.waiting


def test_token_budget_caps_the_step_and_decodes_keep_their_token():
    kv = KVCacheManager(64, B, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=20, long_prefill_token_threshold=16)
    d1, d2 = make_seq(sched, 3), make_seq(sched, 3)
    step(sched, sched.schedule())
    p = make_seq(sched, 50)
    out = sched.schedule()
    assert rows(out) == [(d1, 1), (d2, 1), (p, 16)]
    step(sched, out)
    # The long prompt's chunk stays within the threshold and the step's budget.
    out = sched.schedule()
    assert rows(out) == [(d1, 1), (d2, 1), (p, 16)]
    assert out.num_tokens <= 20


def test_preemption_victim_is_newest_running_and_goes_to_queue_front():
    kv = KVCacheManager(4, B, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1000)
    a, b, c = (make_seq(sched, 16) for _ in range(3))
    out = sched.schedule()
    assert rows(out) == [(a, 16), (b, 16), (c, 16)]
    step(sched, out)                        # each now 17 tokens; 3 of 4 blocks used
    d = make_seq(sched, 16)
    out = sched.schedule()
    # Running sequences go first: a takes the free block, b finds none and preempts c (the
    # newest running); a step that preempted admits nobody, so d keeps waiting behind c.
    assert out.preempted == [c]
    assert rows(out) == [(a, 1), (b, 1)]
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0
    assert c.seq_id not in kv.tables
    assert list(sched.waiting) == [c, d]
    assert sched.running == [a, b]
    assert sched.num_preemptions == 1
    assert [len(kv.block_table(s.seq_id).block_ids) for s in (a, b)] == [2, 2]
    assert kv.pool.num_available == 0
    kv.check_integrity()
    step(sched, out)

    # Finish a: its 2 blocks free; c comes back first (recomputing all 17 tokens).
    sched.finish(a, "length")
    out = sched.schedule()
    assert rows(out) == [(b, 1), (c, 17)]
    assert list(sched.waiting) == [d]


def test_manager_can_ever_fit():
    kv = KVCacheManager(4, B)
    assert kv.can_ever_fit(4 * B) and not kv.can_ever_fit(4 * B + 1)
    rm = KVCacheManager(8, B, policy="reserve-max", max_model_len=3 * B)
    assert rm.can_ever_fit(8 * B)   # reserve-max: every sequence needs its fixed reservation


# -- cache-aware admission (scheduling_policy lpm) ------------------------------------------
def _prefixed(sched: Scheduler, prefix: list[int], tail: int, arrival: float, max_tokens: int = 2) -> Sequence:
    sid = next(_ids)
    prompt = prefix + [(sid * 13 + i) % 900 + 50 for i in range(tail)]
    req = Request(f"r{sid}", None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens,
                  arrival_time=arrival)
    seq = Sequence(sid, req, 0, list(prompt), len(prompt), seed=0, status=SeqStatus.PENDING)
    req.seqs.append(seq)
    sched.add(seq)
    return seq


def _drain_one_at_a_time(sched: Scheduler) -> list[Sequence]:
    """Run to the end with one sequence at a time (max_num_seqs=1); the admission order."""
    order: list[Sequence] = []
    while sched.num_unfinished:
        out = sched.schedule()
        order += [s.seq for s in out.scheduled if s.seq not in order]
        step(sched, out)
    return order


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_does_not():
    import time

    hot = [7] * (4 * B)
    for policy, expect_cold_first in (("fcfs", True), ("lpm", False)):
        kv = KVCacheManager(64, B)
        sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=1000, policy=make_policy(policy, 3600))
        warm = _prefixed(sched, hot, 3, time.time())
        _drain_one_at_a_time(sched)          # the hot prefix is now cached (free, still hittable)
        now = time.time()
        cold = _prefixed(sched, [9] * (4 * B), 3, now)
        hits = [_prefixed(sched, hot, 5, now + i * 1e-3) for i in range(3)]
        order = _drain_one_at_a_time(sched)
        assert (order[0] is cold) == expect_cold_first, policy
        if policy == "lpm":
            assert order == hits + [cold], "longest cached prefix first, ties by arrival"
        assert warm.finished


def test_lpm_aging_bound_puts_the_oldest_request_first_once_it_waited_the_bound():
    """The oldest waiting request, once it has been the oldest for the aging bound (first come,
    first served would have admitted it by then), goes ahead of every younger one, whatever
    they have cached; before that, hits pass it."""
    import time

    hot = [7] * (4 * B)
    kv = KVCacheManager(64, B)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=1000, policy=LongestPrefixMatch(0.5))
    _prefixed(sched, hot, 3, time.time())
    _drain_one_at_a_time(sched)
    now = time.time()
    cold = _prefixed(sched, [9] * (4 * B), 3, now)
    more = [_prefixed(sched, hot, 5, now + 1e-3) for _ in range(3)]
    out = sched.schedule()
    assert out.scheduled[0].seq is more[0], "young: the hit passes it"
    assert cold.request.oldest_since is not None
    step(sched, out)
    cold.request.oldest_since -= 0.6        # it has been the oldest past the bound
    while sched.running:
        step(sched, out := sched.schedule())
    out = sched.schedule()
    assert out.scheduled[0].seq is cold, "aged: ahead of the younger hits"
    step(sched, out)
    assert _drain_one_at_a_time(sched) == [cold] + more[1:]


def test_lpm_waiting_time_stays_within_the_aging_bound_under_a_stream_of_hits():
    """A stream of cache hits keeps arriving; the cold request still starts within the
    aging bound (plus one request's service) of when FCFS would have started it."""
    import time

    hot = [7] * (4 * B)
    kv = KVCacheManager(64, B)
    bound = 0.2
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=1000, policy=LongestPrefixMatch(bound))
    _prefixed(sched, hot, 3, time.time())
    _drain_one_at_a_time(sched)
    cold = _prefixed(sched, [9] * (4 * B), 3, time.time())
    started = None
    deadline = time.time() + 5
    while started is None and time.time() < deadline:
        if len(sched.waiting) < 4:
            _prefixed(sched, hot, 5, time.time())   # hits keep coming
        out = sched.schedule()
        if any(s.seq is cold for s in out.scheduled):
            started = time.time()
        step(sched, out)
        time.sleep(0.01)
    assert started is not None, "the cold request starved"
    assert started - cold.request.arrival_time <= bound + 0.1


def test_queue_policies_and_swap_refuse_bad_settings():
    kv = KVCacheManager(8, B)
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(kv, 1, 100, policy="random")
    with pytest.raises(ValueError, match="aging_bound"):
        make_policy("lpm", -1)
    with pytest.raises(ValueError, match="preemption_mode"):
        TierLoads("evict")
    with pytest.raises(ValueError, match="kv_offload_dir"):
        EngineConfig(preemption_mode="swap")


# -- priority scheduling (vLLM's --scheduling-policy priority) ---------------------------------
def test_priority_request_overtakes_a_queue_of_low_priority_ones():
    """One seat at a time: ten low-priority requests queue first, then one of priority -1
    arrives; it is admitted as soon as the seat frees, ahead of the nine still waiting (FCFS
    would run it last), and the others keep their arrival order behind it."""
    kv = KVCacheManager(64, B, enable_prefix_caching=False)
    for policy, first_after in (("priority", True), ("fcfs", False)):
        sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=1000, policy=policy)
        low = [make_seq(sched, 5, max_tokens=2, priority=5) for _ in range(10)]
        step(sched, sched.schedule())        # low[0] runs
        urgent = make_seq(sched, 5, max_tokens=2, priority=-1)
        order = [low[0]] + [s for s in _drain_one_at_a_time(sched) if s is not low[0]]
        assert (order[1] is urgent) == first_after, policy
        if policy == "priority":
            assert order == [low[0], urgent] + low[1:]
        else:
            assert order == low + [urgent]


def test_priority_preempts_the_lowest_priority_running_request():
    """Blocks run out: FCFS preempts the newest running sequence, priority the one of the
    lowest priority (the highest value) whatever its age; it resumes once it is first again."""
    for policy in ("priority", "fcfs"):
        kv = KVCacheManager(4, B, enable_prefix_caching=False)
        sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1000, policy=policy)
        a = make_seq(sched, 15, priority=9)     # oldest, lowest priority: admitted first, alone
        step(sched, sched.schedule())
        _, c = make_seq(sched, 16, priority=0), make_seq(sched, 16, priority=0)
        step(sched, sched.schedule())           # 17 tokens each: 3 of 4 blocks
        out = sched.schedule()
        want = a if policy == "priority" else c
        assert out.preempted == [want], policy
        assert want.status is SeqStatus.WAITING and want.seq_id not in kv.tables
        kv.check_integrity()
