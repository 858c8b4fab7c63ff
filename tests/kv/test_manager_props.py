"""Property tests of the KV cache manager: random allocate / append / fork / free /
prefix hit / evict sequences, checking the invariants after every step. A shadow
"KV store" (slot -> token written) checks that copy-on-write isolates sequences."""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.kv import KVCacheManager
from pagedllm.viz.state import KVReplay, kv_picture

B = 4
NUM_BLOCKS = 24
# A small vocabulary and a few shared stems make prefix hits frequent.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


def watched(kv: KVCacheManager) -> KVReplay:
    replay = KVReplay(kv.pool.num_blocks)
    kv.watch(replay.apply)
    return replay


def assert_replay_matches(kv: KVCacheManager, replay: KVReplay) -> None:
    """The event stream alone rebuilds the manager's tables, ref counts and cache marks."""
    assert replay.picture() == kv_picture(kv)


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, B, enable_prefix_caching=True)
        self.replay = watched(self.kv)
        self.tokens: dict[int, list[int]] = {}  # seq -> tokens it holds KV for
        self.store: dict[int, int] = {}         # slot -> token id whose KV sits there
        self.next_id = 0

    def _write(self, seq: int, start: int, copies: list[tuple[int, int]]) -> None:
        """What the runner does: copy blocks, then write the new tokens' KV."""
        for src, dst in copies:
            for off in range(B):
                if src * B + off in self.store:
                    self.store[dst * B + off] = self.store[src * B + off]
        table = self.kv.block_table(seq)
        for j in range(start, len(self.tokens[seq])):
            self.store[table.slot(j)] = self.tokens[seq][j]

    @rule(stem=st.integers(0, len(STEMS) - 1), extra=st.lists(st.integers(0, 3), max_size=6))
    def add_sequence(self, stem: int, extra: list[int]) -> None:
        toks = STEMS[stem] + extra
        hit = self.kv.lookup_prefix(toks)
        assert len(hit) * B <= len(toks) - 1, "a hit must leave the last token to compute"
        for i, b in enumerate(hit):  # a hit block really holds this prefix's tokens
            assert [self.store.get(b * B + o) for o in range(B)] == toks[i * B:(i + 1) * B]
        seq = self.next_id
        copies = self.kv.allocate_slots(seq, toks, len(toks), hit)
        if copies is None:
            return
        self.next_id += 1
        self.tokens[seq] = toks
        assert copies == []
        self._write(seq, len(hit) * B, copies)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tok=st.integers(0, 9), count=st.integers(1, 5))
    def append(self, data, tok: int, count: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        new = self.tokens[seq] + [tok] * count
        start = len(self.tokens[seq])
        copies = self.kv.allocate_slots(seq, new, len(new))
        if copies is None:
            return
        self.tokens[seq] = new
        self._write(seq, start, copies)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(1, len(self.tokens[parent])))
        child = self.next_id
        self.next_id += 1
        assert self.kv.fork(parent, child, n) == []
        self.tokens[child] = self.tokens[parent][:n]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(seq)
        del self.tokens[seq]

    @rule()
    def reset_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def refcounts_and_partition(self) -> None:
        self.kv.check_integrity()
        pool = self.kv.pool
        used = {b for s in self.tokens for b in self.kv.block_table(s).block_ids}
        free = set(pool.free_queue)
        assert not used & free, "a block in use is also in the free queue"
        assert len(used) + len(free) == NUM_BLOCKS
        cached_free = {b for b in free if pool.blocks[b].block_hash is not None}
        assert len(cached_free) == pool.num_cached_free

    @invariant()
    def events_rebuild_state(self) -> None:
        assert_replay_matches(self.kv, self.replay)

    @invariant()
    def tables_cover_tokens(self) -> None:
        for s, toks in self.tokens.items():
            t = self.kv.block_table(s)
            assert t.num_tokens == len(toks)
            assert len(t.block_ids) == -(-len(toks) // B), "paged holds exactly ceil(len / B) blocks"

    @invariant()
    def kv_isolated(self) -> None:
        """Every sequence reads back exactly its own tokens: no write through a shared
        block ever leaked into another sequence's view."""
        for s, toks in self.tokens.items():
            t = self.kv.block_table(s)
            assert [self.store.get(t.slot(j)) for j in range(len(toks))] == toks

    def teardown(self) -> None:
        for s in list(self.tokens):
            self.kv.free(s)
        self.kv.check_integrity()
        assert self.kv.pool.num_free == NUM_BLOCKS, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


KVManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVManager = KVManagerMachine.TestCase


class ReserveMaxMachine(RuleBasedStateMachine):
    """The traditional policy: contiguous first-fit reservations of max_model_len."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, B, policy="reserve-max", max_model_len=5 * B)
        self.replay = watched(self.kv)
        self.live: dict[int, int] = {}
        self.next_id = 0

    @rule(n=st.integers(1, 5 * B))
    def admit(self, n: int) -> None:
        seq = self.next_id
        self.next_id += 1
        if self.kv.allocate_slots(seq, list(range(n)), n) is not None:
            self.live[seq] = n
            ids = self.kv.block_table(seq).block_ids
            assert ids == list(range(ids[0], ids[0] + 5)), "reservation must be contiguous"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow_or_free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live)))
        if data.draw(st.booleans()) and self.live[seq] < 5 * B:
            n = self.live[seq] + 1
            assert self.kv.allocate_slots(seq, list(range(n)), n) == [], "growing within the reservation is free"
            self.live[seq] = n
        else:
            self.kv.free(seq)
            del self.live[seq]

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        assert_replay_matches(self.kv, self.replay)
        assert self.kv.pool.num_used == 5 * len(self.live)


ReserveMaxMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestReserveMax = ReserveMaxMachine.TestCase
