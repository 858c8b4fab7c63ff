"""Property tests of the KV cache manager: random allocate (whole or in chunks) / append /
fork / free / prefix hit / evict sequences under drawn cache salts, checking the invariants
after every step.

A shadow "KV store" keys what each physical slot holds by the token's whole history: the
sequence's salt and every token id up to and including it. A block is interchangeable only
with one of the same history, so a prefix hit that serves a block with the right tokens but
another parent, or another tenant's salt, fails here; so does copy-on-write that lets one
sequence's write leak into another's view.

The same machine runs under a sliding window (WindowedKVManagerMachine): blocks below the
window of every later query go back to the pool, their entries -1 (RELEASED); and beside a
recurrent state (StateKVManagerMachine), whose shadow holds per block the history of the
state written there: each step reads the state its first token's predecessor left and writes
one per block it fills, so a hit or a fork that restarts from another history's state fails."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.kv import KVCacheManager
from pagedllm.kv.block_table import RELEASED
from pagedllm.kv.groups import KV, STATE, STATE_WINDOW
from pagedllm.kv.hashing import BlockHashes
from pagedllm.util import cdiv
from pagedllm.viz.state import KVReplay, kv_picture

B = 4
NUM_BLOCKS = 24
# A small vocabulary and a few shared stems make prefix hits frequent; the last stem repeats
# one full block, so its second block has the first one's tokens under another parent.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]
SALTS = st.sampled_from([None, "a", "b"])
# LoRA adapters paged in the same pool (kv.adapter_pages): id -> its size in pages.
ADAPTERS = {1: 3, 2: 5, 3: 2}

# What one slot holds: (salt, token ids from the sequence's start up to this token).
History = tuple[str | None, tuple[int, ...]]


def watched(kv: KVCacheManager) -> KVReplay:
    replay = KVReplay(kv.pool.num_blocks, windows=[g.window for g in kv.groups] if len(kv.groups) > 1 else None)
    kv.watch(replay.apply)
    return replay


def assert_replay_matches(kv: KVCacheManager, replay: KVReplay) -> None:
    """The event stream alone rebuilds the manager's tables, ref counts and cache marks."""
    assert replay.picture() == kv_picture(kv)


class KVManagerMachine(RuleBasedStateMachine):
    WINDOW = 0
    GROUPS: tuple[int, ...] | None = None   # each layer group's window; None: one group of WINDOW
    KINDS: tuple[str, ...] | None = None    # what each group's blocks hold; None: K/V

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, B, enable_prefix_caching=True, sliding_window=self.WINDOW,
                                 group_windows=self.GROUPS, group_kinds=self.KINDS)
        self.windows = [g.window for g in self.kv.groups]
        self.kinds = [g.holds for g in self.kv.groups]
        self.state: dict[int, History] = {}          # block -> the history of the state written there
        self.replay = watched(self.kv)
        self.tokens: dict[int, list[int]] = {}       # seq -> tokens it holds KV for
        self.future: dict[int, list[int]] = {}       # seq -> prompt tokens it has not reached yet
        self.hashes: dict[int, BlockHashes] = {}     # seq -> its block keys, one object for all calls
        self.salt: dict[int, str | None] = {}
        self.store: dict[int, History] = {}          # slot -> the history of the token written there
        self.next_id = 0
        self.adapter_users = {a: 0 for a in ADAPTERS}   # running sequences using each adapter

    def _history(self, seq: int, j: int) -> History:
        return self.salt[seq], tuple(self.tokens[seq][:j + 1])

    def _write(self, seq: int, start: int, copies: list[tuple[int, int]]) -> None:
        """What the runner does: copy blocks, then write the new tokens' KV, in every group's
        blocks (each group's are its own: a slot holds one history whatever group wrote it)."""
        for src, dst in copies:
            for off in range(B):
                if src * B + off in self.store:
                    self.store[dst * B + off] = self.store[src * B + off]
            if src in self.state:
                self.state[dst] = self.state[src]
        n = len(self.tokens[seq])
        for g in range(len(self.windows)):
            table = self.kv.block_table(seq, g)
            if self.kinds[g] == STATE:
                # read the state token start - 1 left, then write one into every block this step
                # fills and into the block its last token ends in
                if start:
                    assert self.state.get(table.block_ids[(start - 1) // B]) == self._history(seq, start - 1), \
                        "a step starts from another history's state"
                for j in range(start, n):
                    if j % B == B - 1 or j == n - 1:
                        self.state[table.block_ids[j // B]] = self._history(seq, j)
                continue
            for j in range(start, n):
                self.store[table.slot(j)] = self._history(seq, j)

    def _lookup(self, toks: list[int], salt: str | None) -> tuple[list[int], BlockHashes]:
        self.kv.begin_step()   # every rule is a step of its own: what earlier ones wrote is computed
        hashes = self.kv.new_hashes(salt)
        hit = self.kv.lookup_prefix(toks, hashes)
        assert len(hit) * B <= len(toks) - 1, "a hit must leave the last token to compute"
        assert [len(h) for h in hit.per_group] == [len(hit)] * len(self.windows), "groups hit different prefixes"
        for g, blocks in enumerate(hit.per_group):
            first = self.kv.first_window_block(len(hit) * B, g)
            assert RELEASED not in blocks[first:], "a hit lacks a block its window reads"
            if self.kinds[g] == STATE:   # its last block holds the prefix's state; the rest are not read
                assert not blocks or self.state.get(blocks[-1]) == (salt, tuple(toks[:len(blocks) * B])), \
                    f"group {g}: the hit's state has another history"
                continue
            for i, b in enumerate(blocks):  # a hit block holds exactly this prefix, under this salt
                if b == RELEASED:
                    continue
                want = [(salt, tuple(toks[:i * B + o + 1])) for o in range(B)]
                assert [self.store.get(b * B + o) for o in range(B)] == want, f"group {g}: hit block {i} has another history"
        # a request waiting for room looks up again each step, with the same keys
        assert self.kv.lookup_prefix(toks, hashes) == hit
        # what is kept beside the hit blocks (here: the history they were kept for) is theirs
        kept = self.kv.scores.kept(hashes.keys[:len(hit)])
        assert kept == [(salt, tuple(toks[:(i + 1) * B])) for i in range(len(kept))], "kept scores of another history"
        return hit, hashes

    def _admit(self, toks: list[int], salt: str | None, chunks: list[int]) -> None:
        """Look the prompt up, then give it slots in chunks (cumulative token counts past
        the hit, as chunked prefill does), writing each chunk's KV before the next."""
        hit, hashes = self._lookup(toks, salt)
        start = len(hit) * B
        ends = sorted({min(len(toks), start + c) for c in chunks} | {len(toks)})
        seq = self.next_id
        copies = self.kv.allocate_slots(seq, toks, ends[0], hit, hashes)
        if copies is None:
            return
        assert copies == [], "a new sequence writes only into blocks of its own"
        self.next_id += 1
        self.tokens[seq], self.future[seq] = toks[:ends[0]], toks[ends[0]:]
        self.hashes[seq], self.salt[seq] = hashes, salt
        self._write(seq, start, copies)
        self._check_step(seq, ends[0] - start)
        for end in ends[1:]:
            if not self._grow(seq, end - len(self.tokens[seq])):
                return  # out of room mid-prompt: it holds what it got, the rest stays in `future`

    def _grow(self, seq: int, count: int) -> bool:
        """Slots for `count` more tokens: the rest of its prompt first, then new ones."""
        held = len(self.tokens[seq])
        fut = self.future[seq]
        new = self.tokens[seq] + fut[:count]
        new += [new[-1] % 10] * (held + count - len(new))  # past the prompt: a decoded token
        self.kv.begin_step()
        copies = self.kv.allocate_slots(seq, new + fut[count:], len(new), hashes=self.hashes[seq])
        if copies is None:
            return False
        self.tokens[seq], self.future[seq] = new, fut[count:]
        self._write(seq, held, copies)
        self._check_step(seq, count)
        return True

    def _check_step(self, seq: int, count: int) -> None:
        """Right after a step gave it slots for `count` tokens, a windowed sequence holds at
        most the blocks of its window and those tokens."""
        for g, w in enumerate(self.windows):
            if w:
                t = self.kv.block_table(seq, g)
                assert len(t.held) <= cdiv(w - 1 + count, B) + 1, (t.block_ids, count)

    @rule(stem=st.integers(0, len(STEMS) - 1), extra=st.lists(st.integers(0, 3), max_size=6), salt=SALTS)
    def add_sequence(self, stem: int, extra: list[int], salt: str | None) -> None:
        self._admit(STEMS[stem] + extra, salt, [])

    @rule(stem=st.integers(0, len(STEMS) - 1), extra=st.lists(st.integers(0, 3), max_size=8), salt=SALTS,
          chunks=st.lists(st.integers(1, 17), min_size=1, max_size=4))
    def add_sequence_in_chunks(self, stem: int, extra: list[int], salt: str | None, chunks: list[int]) -> None:
        """Chunked prefill: several allocate_slots calls of partial lengths, often ending
        mid-block, with the whole prompt's token ids each time."""
        self._admit(STEMS[stem] + extra, salt, chunks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=3),
          chunks=st.lists(st.integers(1, 17), max_size=3))
    def add_continuation(self, data, extra: list[int], chunks: list[int]) -> None:
        """A later turn of a conversation: a sequence's whole history and more, under its
        salt. Under a window its early blocks may be released and evicted by now, so the hit
        may lack blocks no query of the new sequence reads."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self._admit(self.tokens[seq] + extra, self.salt[seq], chunks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tok=st.integers(0, 9), count=st.integers(1, 5))
    def append(self, data, tok: int, count: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.future[seq]:
            self.future[seq] = [tok] * count  # decoded tokens: known only as they come
        self._grow(seq, count)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        lo = 1   # a child must find the keys its window reads, in every group
        for g, w in enumerate(self.windows):
            released = self.kv.block_table(parent, g).num_released
            lo = max(lo, released * B + w - 1 if released else 1)
        if lo > len(self.tokens[parent]):
            return
        n = data.draw(st.integers(lo, len(self.tokens[parent])))
        if STATE in self.kinds and n % B and n != len(self.tokens[parent]):   # a state is kept at the last token
            with pytest.raises(ValueError, match="recurrent state"):
                self.kv.fork(parent, self.next_id, n)
            n = len(self.tokens[parent])
        child = self.next_id
        self.next_id += 1
        assert self.kv.fork(parent, child, n) == []
        self.tokens[child], self.future[child] = self.tokens[parent][:n], []
        self.salt[child] = self.salt[parent]
        self.hashes[child] = self.kv.block_table(child).hashes  # the parent's keys, cut at n

    @precondition(lambda self: any(not f for f in self.future.values()))
    @rule(data=st.data(), toks=st.lists(st.integers(0, 9), min_size=2, max_size=3, unique=True))
    def beam_step(self, data, toks: list[int]) -> None:
        """One beam-search step: a beam chosen len(toks) times forks at its full length with
        the parent's keys (as the scheduler's fork does), then each copy writes a different
        next token, the first writers into the shared partial block copying it."""
        parent = data.draw(st.sampled_from(sorted(s for s, f in self.future.items() if not f)))
        n = len(self.tokens[parent])
        beams = [parent]
        for _ in toks[1:]:
            child = self.next_id
            self.next_id += 1
            hashes = self.hashes[parent].prefix(n)
            assert self.kv.fork(parent, child, hashes=hashes) == []
            self.tokens[child], self.future[child] = list(self.tokens[parent]), []
            self.salt[child], self.hashes[child] = self.salt[parent], hashes
            beams.append(child)
        for seq, tok in zip(beams, toks):
            self.future[seq] = [tok]
            self._grow(seq, 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(seq)
        for d in (self.tokens, self.future, self.hashes, self.salt):
            del d[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def keep_prompt_scores(self, data) -> None:
        """What the scheduler keeps beside a sequence's full blocks once scored (here each
        block's history, so a lookup can tell whose it serves)."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[seq]
        keys = self.hashes[seq].keys
        for b in range(min(len(toks) // B, len(keys))):
            self.kv.scores.keep(keys[b], (self.salt[seq], tuple(toks[:(b + 1) * B])), nbytes=1)

    @rule()
    def reset_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @rule(adapter=st.sampled_from(sorted(ADAPTERS)))
    def use_adapter(self, adapter: int) -> None:
        """A sequence of this adapter starts: its pages are held, placed (and written by the
        runner: here each slot of page i gets ("adapter", id, i)) if it was not resident."""
        if not self.kv.adapters.acquire(adapter, ADAPTERS[adapter]):
            assert self.kv.pool.num_available < ADAPTERS[adapter] and not self.adapter_users[adapter]
            return
        self.adapter_users[adapter] += 1
        for a, blocks in self.kv.adapters.take_loads():
            for i, b in enumerate(blocks):
                for off in range(B):
                    self.store[b * B + off] = ("adapter", a, i)

    @precondition(lambda self: any(self.adapter_users.values()))
    @rule(data=st.data())
    def stop_using_adapter(self, data) -> None:
        adapter = data.draw(st.sampled_from([a for a, n in self.adapter_users.items() if n]))
        self.kv.adapters.release(adapter)
        self.adapter_users[adapter] -= 1

    @invariant()
    def adapters_keep_their_pages(self) -> None:
        """A resident adapter's pages (held, or idle and revivable) still hold its weights: no
        KV write or copy reached them; a held one is resident."""
        ad = self.kv.adapters
        assert {a for a, n in self.adapter_users.items() if n} == set(ad.users)
        for a, blocks in ad.pages.items():
            assert len(blocks) == ADAPTERS[a]
            for i, b in enumerate(blocks):
                assert [self.store.get(b * B + o) for o in range(B)] == [("adapter", a, i)] * B, \
                    f"adapter {a} page {i} (block {b}) was overwritten"

    @invariant()
    def refcounts_and_partition(self) -> None:
        self.kv.check_integrity()
        pool = self.kv.pool
        used = {b for s in self.tokens for g in range(len(self.windows)) for b in self.kv.block_table(s, g).held}
        pages = {b for a in self.kv.adapters.users for b in self.kv.adapters.pages[a]}
        assert not used & pages, "a block is both KV and an adapter's page"
        used |= pages
        free = set(pool.free_queue)
        assert not used & free, "a block in use is also in the free queue"
        assert len(used) + len(free) == NUM_BLOCKS
        cached_free = {b for b in free if pool.blocks[b].block_hash is not None}
        assert len(cached_free) == pool.num_cached_free
        held = [len({b for s in self.tokens for b in self.kv.block_table(s, g).held}) for g in range(len(self.windows))]
        assert [f.held_blocks for f in self.kv.stats().groups] == held

    @invariant()
    def events_rebuild_state(self) -> None:
        assert_replay_matches(self.kv, self.replay)

    def _tables(self):
        """(group, window, seq, its table, its tokens) for every sequence in every group."""
        for g, w in enumerate(self.windows):
            for s, toks in self.tokens.items():
                yield g, w, s, self.kv.block_table(s, g), toks

    @invariant()
    def tables_cover_tokens(self) -> None:
        for _, _, _, t, toks in self._tables():
            assert t.num_tokens == len(toks)
            assert len(t.block_ids) == -(-len(toks) // B), "paged holds exactly ceil(len / B) blocks"

    @invariant()
    def kv_isolated(self) -> None:
        """Every sequence reads back exactly its own history, slot by slot, in every group: no
        write through a shared block ever leaked into another sequence's view."""
        for g, _, s, t, toks in self._tables():
            if self.kinds[g] == STATE:   # the state its next query reads: after all its tokens
                assert self.state.get(t.block_ids[(len(toks) - 1) // B]) == self._history(s, len(toks) - 1)
                continue
            lo = t.num_released * B  # below it: released, read by no later query
            assert [self.store.get(t.slot(j)) for j in range(lo, len(toks))] == \
                [self._history(s, j) for j in range(lo, len(toks))]

    @invariant()
    def window_releases_only_what_no_query_reads(self) -> None:
        """-1 entries lead each table, and only below the window of its next query (at its
        length): every key that query reads is held. A full-attention group has none."""
        for g, w, _, t, toks in self._tables():
            assert t.block_ids[:t.num_released] == [RELEASED] * t.num_released
            assert RELEASED not in t.held
            assert t.num_released <= self.kv.first_window_block(len(toks), g)
            if not w:
                assert t.num_released == 0

    @invariant()
    def cached_blocks_hold_their_history(self) -> None:
        """A block in the prefix cache holds one full block's history under one salt, and
        no other cached block holds the same: one key per history, one block per key."""
        seen: dict[tuple[History, int], int] = {}
        state_salts = [g.salt for g in self.kv.groups if g.holds == STATE]
        for blk in self.kv.pool.blocks:
            if blk.block_hash is None or blk.block_hash < 0:   # < 0: an adapter's page (adapters_keep_their_pages)
                continue
            st_salt, st_hist = self.state.get(blk.block_id, (None, ()))
            if state_salts and st_hist and len(st_hist) % B == 0 and \
                    BlockHashes(B, st_salt).update(st_hist)[-1] ^ state_salts[0] == blk.block_hash:
                # a state block: the state at its block's end
                assert (st_hist, -1, st_salt) not in seen, "two blocks cache one state"
                seen[st_hist, -1, st_salt] = blk.block_id
                continue
            slots = [self.store.get(blk.block_id * B + o) for o in range(B)]
            assert None not in slots, f"cached block {blk.block_id} was never fully written"
            salt, last = slots[-1]
            assert len(last) % B == 0 and all(h == (salt, last[:len(last) - B + o + 1]) for o, h in enumerate(slots))
            key = BlockHashes(B, salt).update(last)[-1]   # the history's key: each group caches it under its own
            group = [g.salt ^ key for g in self.kv.groups].index(blk.block_hash)
            assert (slots[-1], group) not in seen, f"blocks {seen.get((slots[-1], group))} and {blk.block_id} cache one history"
            seen[slots[-1], group] = blk.block_id

    @invariant()
    def kept_scores_live_and_die_with_their_block(self) -> None:
        """An entry is kept only while its hash is cached, beside the block of its history."""
        pool = self.kv.pool
        for key, (entry, _) in self.kv.scores.entries.items():
            blk = pool.cached[key]
            assert self.store.get(blk * B + B - 1) == entry, f"block {blk} keeps another history's scores"

    def teardown(self) -> None:
        for s in list(self.tokens):
            self.kv.free(s)
        for a, n in self.adapter_users.items():
            for _ in range(n):
                self.kv.adapters.release(a)
        self.kv.check_integrity()
        assert self.kv.pool.num_available == NUM_BLOCKS, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


KVManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVManager = KVManagerMachine.TestCase


class WindowedKVManagerMachine(KVManagerMachine):
    """Every query sees its last WINDOW keys: sequences release the blocks below it as they
    grow, and prefix hits may lack blocks no query of theirs reads."""
    WINDOW = 6

    @invariant()
    def window_bounds_what_a_sequence_holds(self) -> None:
        """Between steps a sequence holds at most its window's blocks and one step's tokens'
        (here at most 17: a prompt's first chunk past its hit)."""
        for s in self.tokens:
            assert len(self.kv.block_table(s).held) <= cdiv(self.WINDOW - 1 + 17, B) + 1


WindowedKVManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestWindowedKVManager = WindowedKVManagerMachine.TestCase


class HybridKVManagerMachine(KVManagerMachine):
    """Layers of two attention types (Gemma 3, Qwen2's max_window_layers): a full-attention
    group keeps every block while a windowed group releases its own below its window; both
    draw from one pool, a hit is the longest prefix both serve, each caches its own blocks."""
    GROUPS = (0, 6)

    @invariant()
    def window_group_bounds_what_it_holds(self) -> None:
        for s, toks in self.tokens.items():
            assert len(self.kv.block_table(s, 1).held) <= cdiv(6 - 1 + 17, B) + 1
            assert len(self.kv.block_table(s, 0).held) == cdiv(len(toks), B)


HybridKVManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestHybridKVManager = HybridKVManagerMachine.TestCase


class StateKVManagerMachine(KVManagerMachine):
    """A hybrid model's attention layers beside recurrent ones (LFM2, Granite 4.0-H): the
    state group keeps the state after each full block and after the last token, releases
    the rest as the sequence moves on, restarts a hit from its last block's state, and
    copies a shared last block before writing (fork, beams)."""
    GROUPS, KINDS = (0, STATE_WINDOW), (KV, STATE)

    @invariant()
    def state_group_holds_one_step(self) -> None:
        for s, toks in self.tokens.items():
            assert len(self.kv.block_table(s, 1).held) <= cdiv(17, B) + 1


StateKVManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestStateKVManager = StateKVManagerMachine.TestCase


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
