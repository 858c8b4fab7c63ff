"""Property tests of the KV manager over pool + tier (a real TierStore on a temporary
folder): random admissions (with tier loads), growth, frees, evictions, swap-outs, flushes,
corrupted files and restarts, checking after every step that

- ref counts equal table references plus pins, and used / cached-free / free partition the pool;
- a block served by a prefix hit, from the pool or loaded from the tier, holds exactly the
  history its key names (the salt and every token up to it), so nothing crosses salts; in a
  hybrid model's groups (full, windowed, recurrent state), every block the hit's queries read
  does, and a state block holds the state of the whole prefix;
- the replayed event stream rebuilds the manager's state;
- vLLM's KV events (kv.events) rebuild the set of blocks a router may route to: every block
  a table holds as cached was announced, nothing announced has left the cache, and each
  announced block's token ids and parent hash to its key;
- after a full drain no block is referenced and only the tier's entries remain.

The runner is simulated: a block's bytes are the digests of what its slots hold, carried
through saves (copied at once), loads and writes (read when the write is queued) as the
model runner does."""
from __future__ import annotations

import os
import shutil
import tempfile

import hypothesis.strategies as st
import xxhash
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedllm.kv import KVCacheManager
from pagedllm.kv.block_table import RELEASED
from pagedllm.kv.connector import OffloadConnector
from pagedllm.kv.events import BlockRemoved, BlockStored
from pagedllm.kv.groups import KV, STATE, STATE_WINDOW
from pagedllm.kv.hashing import BlockHashes, hash_block
from pagedllm.kv.single_type import group_salt
from pagedllm.kv.tier_store import TierStore, fingerprint
from pagedllm.viz.state import KVReplay, kv_picture

B = 4
NUM_BLOCKS = 12
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 14]
SALTS = st.sampled_from([None, "a", "b"])
SLOT = 8  # bytes a slot's digest takes in a block's payload
FP = fingerprint("tier-props")


def digest(history: tuple) -> bytes:
    return xxhash.xxh3_64_digest(repr(history).encode())


class TierMachine(RuleBasedStateMachine):
    POLICY = "write_through"
    GROUPS: tuple[int, ...] | None = None   # each layer group's window; None: one full group
    KINDS: tuple[str, ...] | None = None    # what each group's blocks hold; None: K/V

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tier-props-")
        self.capacity = 10 * (B * SLOT + 64)   # smaller than the pool's worth: the tier evicts too
        self._open()
        self.history: dict[bytes, tuple] = {}

    def _open(self) -> None:
        self.store = TierStore(self.dir, self.capacity, FP, B * SLOT)
        self.kv = KVCacheManager(NUM_BLOCKS, B, connector=OffloadConnector(self.store, self.POLICY),
                                 group_windows=self.GROUPS, group_kinds=self.KINDS)
        self.replay = KVReplay(NUM_BLOCKS, windows=list(self.GROUPS) if self.GROUPS else None)
        self.kv.watch(self.replay.apply)
        self.kv.record_events(salted_token_ids=True)   # every block's tokens, to check them against its key
        self.index: dict[int, None] = {}          # what a KV-aware router learns from the events
        self.slots: dict[int, tuple] = {}         # pool slot -> history written there
        self.tokens: dict[int, list[int]] = {}
        self.hashes: dict[int, BlockHashes] = {}
        self.salt: dict[int, str | None] = {}
        self.next_id = getattr(self, "next_id", 0)

    def teardown(self) -> None:
        """Every run ends with a full drain, then the folder goes."""
        try:
            self.drained()
        finally:
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- the simulated runner ----------------------------------------------------
    def _payload(self, block: int) -> bytearray:
        out = bytearray()
        for off in range(B):
            h = self.slots.get(block * B + off)
            d = digest(h) if h is not None else bytes(SLOT)
            if h is not None:
                self.history[d] = h
            out += d
        return out

    def _run_io(self) -> None:
        saves, loads, writes = self.kv.take_io()
        for b, key in saves:
            self.store.put(key, [self._payload(b)])
        for b, payload in loads:
            data = bytes(payload)
            for off in range(B):
                d = data[off * SLOT:(off + 1) * SLOT]
                self.slots[b * B + off] = self.history.get(d)
        return writes

    def _step(self, seq: int, start: int, copies) -> None:
        writes = self._run_io()
        for src, dst in copies:
            for off in range(B):
                if src * B + off in self.slots:
                    self.slots[dst * B + off] = self.slots[src * B + off]
        n = len(self.tokens[seq])
        for g, group in enumerate(self.kv.groups):
            table = self.kv.block_table(seq, g)
            if group.holds == STATE:   # the state after token j, in the first slot of its block
                if start:
                    want = (self.salt[seq], tuple(self.tokens[seq][:start]))
                    assert self.slots.get(table.block_ids[(start - 1) // B] * B) == want, \
                        f"group {g}: a step starts from another history's state"
                for j in range(start, n):
                    if j % B == B - 1 or j == n - 1:
                        self.slots[table.block_ids[j // B] * B] = (self.salt[seq], tuple(self.tokens[seq][:j + 1]))
                continue
            for j in range(start, n):
                self.slots[table.slot(j)] = (self.salt[seq], tuple(self.tokens[seq][:j + 1]))
        for b, key in writes:   # after the forward: the block's tokens are written
            self.store.put(key, [self._payload(b)])

    # -- rules ------------------------------------------------------------------
    @rule(stem=st.integers(0, len(STEMS) - 1), extra=st.lists(st.integers(0, 3), max_size=5), salt=SALTS)
    def admit(self, stem: int, extra: list[int], salt) -> None:
        self.kv.begin_step()
        toks = STEMS[stem] + extra
        hashes = self.kv.new_hashes(salt)
        hit = self.kv.lookup_prefix(toks, hashes)
        hit = self.kv.load_from_tier(self.next_id, hashes, len(toks), hit, limit=NUM_BLOCKS, token_ids=toks)
        assert len(hit) * B <= len(toks) - 1
        self._flush_writes()  # the loads land before anyone reads them (here: the checks below)
        k = len(hit)
        for g, blocks in enumerate(hit.per_group):
            assert len(blocks) == k, "groups hit different prefixes"
            first = self.kv.first_window_block(k * B, g)
            assert RELEASED not in blocks[first:], f"group {g}: the hit lacks a block its queries read"
            if self.kv.groups[g].holds == STATE:   # its last block holds the prefix's state
                assert not k or self.slots.get(blocks[-1] * B) == (salt, tuple(toks[:k * B])), \
                    f"group {g}: the hit's state has another history"
                continue
            for i in range(first, k):
                want = [(salt, tuple(toks[:i * B + o + 1])) for o in range(B)]
                assert [self.slots.get(blocks[i] * B + o) for o in range(B)] == want, \
                    f"group {g}: hit block {i} has another history"
        seq = self.next_id
        copies = self.kv.allocate_slots(seq, toks, len(toks), hit, hashes)
        if copies is None:
            return
        self.next_id += 1
        self.tokens[seq], self.hashes[seq], self.salt[seq] = toks, hashes, salt
        self._step(seq, len(hit) * B, copies)

    # Which sequences exist hangs on the tier's writer thread (an admission fails while a
    # block's write still pins it), so a rule neither waits on them (a precondition) nor draws
    # from them: it draws a number and picks by it, and hypothesis replays the same data
    # whatever the writer did (drawing from the live set failed as FlakyStrategyDefinition).
    def _pick(self, pick: int) -> int | None:
        return sorted(self.tokens)[pick % len(self.tokens)] if self.tokens else None

    @rule(pick=st.integers(0, 1 << 16), tok=st.integers(0, 9), count=st.integers(1, 5))
    def grow(self, pick: int, tok: int, count: int) -> None:
        seq = self._pick(pick)
        if seq is None:
            return
        self.kv.begin_step()
        held = len(self.tokens[seq])
        new = self.tokens[seq] + [tok] * count
        copies = self.kv.allocate_slots(seq, new, len(new), hashes=self.hashes[seq])
        if copies is None:
            return
        self.tokens[seq] = new
        self._step(seq, held, copies)

    @rule(pick=st.integers(0, 1 << 16), swap=st.booleans())
    def free(self, pick: int, swap: bool) -> None:
        """A sequence ends, or is preempted by swap (its blocks saved before they are reused)."""
        seq = self._pick(pick)
        if seq is None:
            return
        if swap:
            self.kv.swap_out(seq)
        self.kv.free(seq)
        del self.tokens[seq]

    def _flush_writes(self) -> None:
        for b, key in self._run_io():
            self.store.put(key, [self._payload(b)])

    @rule()
    def writes_finish(self) -> None:
        """An idle step: finished writes release their blocks, the backlog's go out."""
        self.store.flush()
        self.kv.begin_step()
        self._flush_writes()

    @rule(pick=st.integers(0, 1 << 16), flip=st.booleans(), at=st.integers(0, 1 << 16), bit=st.integers(0, 7))
    def corrupt_a_file(self, pick: int, flip: bool, at: int, bit: int) -> None:
        """Flip a byte of a stored block, or cut it short: it must never be served. The draws
        do not depend on which files exist (that hangs on mtime ties after a restart), so
        hypothesis replays the same data whatever the disk holds."""
        self.store.flush()
        files = sorted(f for f in os.listdir(self.store.dir) if f.endswith(".kvb"))
        if not files:
            return
        path = os.path.join(self.store.dir, files[pick % len(files)])
        raw = bytearray(open(path, "rb").read())
        if not raw:
            return
        if flip:
            raw[at % len(raw)] ^= 1 << bit
        else:
            raw = raw[:at % len(raw)]
        with open(path, "wb") as f:
            f.write(raw)

    @rule()
    def restart(self) -> None:
        """A clean shutdown (write-back flushes the cached blocks) and a new engine on the same folder."""
        self.store.flush()
        for seq in list(self.tokens):
            self.kv.free(seq)
        self._flush_writes()
        for b, key in self.kv.blocks_to_flush() if self.POLICY == "write_back" else []:
            self.store.put(key, [self._payload(b)])
        self.store.close()
        self._open()

    # -- invariants -------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        assert self.replay.picture() == kv_picture(self.kv)
        assert self.store.stats.bytes <= self.store.stats.capacity_bytes

    @invariant()
    def events_index_the_cache(self) -> None:
        for ev in self.kv.take_events():
            if isinstance(ev, BlockStored):
                gs = group_salt(ev.group_idx)   # a group's keys: the chain's, XOR its salt
                parent = ev.parent_block_hash
                for i, key in enumerate(ev.block_hashes):
                    toks = ev.token_ids[i * B:(i + 1) * B]
                    plain = None if parent is None else parent ^ gs
                    assert any(hash_block(plain, toks, s) ^ gs == key for s in (None, "a", "b")), "tokens miss the key"
                    assert key not in self.index, "announced twice"
                    self.index[key], parent = None, key
            elif isinstance(ev, BlockRemoved):
                for key in ev.block_hashes:
                    assert self.index.pop(key, 0) is None, "removed, never stored"
            else:
                self.index.clear()
        cached = set(self.kv.pool.cached)
        assert set(self.index) <= cached, "announced but gone from the cache"
        for seq, table in self.kv.tables.items():
            # A table's full block whose key another block was cached under first is a duplicate,
            # never cached itself: once that other block is evicted (and its removal told), no
            # block under the key can be hit, so none is announced. Every key still cached is.
            held = [k for k in table.hashes.keys[:table.num_cached_blocks] if k in cached]
            assert set(held) <= set(self.index), "a block a sequence holds as cached was never announced"

    def drained(self) -> None:
        for seq in list(self.tokens):
            self.kv.free(seq)
        self.tokens.clear()
        for _ in range(NUM_BLOCKS):   # as idle steps do: the backlog drains as writes finish
            self._flush_writes()
            self.store.flush()
            self.kv.begin_step()
            if not self.kv.connector.pins:
                break
        assert not self.kv.connector.pins, f"pins left after the drain: {self.kv.connector.pins}"
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks), "a block is still referenced"
        files = {int(f[:-4], 16) for f in os.listdir(self.store.dir) if f.endswith(".kvb")}
        assert files == set(self.store._lru), "the tier's index and its files differ"


class WriteBackMachine(TierMachine):
    POLICY = "write_back"


class HybridTierMachine(TierMachine):
    """A hybrid model's groups: full attention, a window of 6 keys, and a recurrent state
    (kv.groups): a hit reads each group's blocks its queries read, each from the pool or the tier."""
    GROUPS = (0, 6, STATE_WINDOW)
    KINDS = (KV, KV, STATE)


class HybridWriteBackMachine(HybridTierMachine):
    POLICY = "write_back"


TestTierWriteThrough = TierMachine.TestCase
TestTierWriteBack = WriteBackMachine.TestCase
TestHybridTierWriteThrough = HybridTierMachine.TestCase
TestHybridTierWriteBack = HybridWriteBackMachine.TestCase
for _case in (TestTierWriteThrough, TestTierWriteBack, TestHybridTierWriteThrough, TestHybridTierWriteBack):
    _case.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
del _case


def test_a_stored_block_is_found_only_under_its_own_salt(tmp_path) -> None:
    store = TierStore(tmp_path, 1 << 20, FP, B * SLOT)
    kv = KVCacheManager(NUM_BLOCKS, B, connector=OffloadConnector(store))
    toks = list(range(9))
    a = kv.new_hashes("tenant-a")
    kv.lookup_prefix(toks, a)
    assert kv.allocate_slots(0, toks, len(toks), [], a) == []
    _, _, writes = kv.take_io()
    for b, key in writes:
        store.put(key, [bytes(B * SLOT)])
    store.flush()
    other = kv.new_hashes("tenant-b")
    kv.lookup_prefix(toks, other)
    assert kv.tier_prefix(other, len(toks), []) == 0
    mine = kv.new_hashes("tenant-a")
    kv.lookup_prefix(toks, mine)
    assert kv.tier_prefix(mine, len(toks), []) == 2
    store.close()


def test_a_hit_cut_short_by_a_failed_read_keeps_the_pool_blocks_it_reads() -> None:
    """The machine's find, replayed: a state read fails (its file cut to nothing), the hit falls
    back one block, and the shorter hit reads a window group's block the longer one did not.
    That block is cached-free at the head of the queue; the next fresh block (the shorter hit's
    state) must not be it."""
    m = HybridTierMachine()
    try:
        m.admit(stem=2, extra=[0, 0], salt="a")
        m.writes_finish()
        m.grow(pick=0, tok=0, count=1)
        m.writes_finish()
        m.free(pick=0, swap=False)
        m.corrupt_a_file(pick=0, flip=False, at=0, bit=0)
        m.admit(stem=2, extra=[], salt="a")   # asserts every hit block's history
        m.consistent()
        assert m.kv.connector.loaded_blocks == 1, "the hit should have fallen back to one state read"
    finally:
        m.teardown()


def test_a_block_read_for_a_hit_that_fell_back_is_announced() -> None:
    """The write-back machine's find, replayed: after a restart a cut file makes a hit fall back to
    nothing, and the blocks read for it stay cached under their keys. A router's index (the KV
    events) must hear of them: a later request hits them from the pool."""
    m = HybridWriteBackMachine()
    try:
        m.admit(stem=0, extra=[], salt=None)
        m.restart()
        m.corrupt_a_file(pick=21757, flip=False, at=0, bit=0)
        for rule in (lambda: m.admit(stem=1, extra=[], salt=None), lambda: m.grow(pick=0, tok=0, count=1),
                     lambda: m.grow(pick=0, tok=0, count=4), lambda: m.admit(stem=0, extra=[], salt=None)):
            rule()
            m.consistent()
            m.events_index_the_cache()
    finally:
        m.teardown()


def test_only_the_blocks_read_are_announced_not_stale_sources() -> None:
    """The write-back machine's second find, replayed: a window group's source past the hit named a
    block that a later read of the same hit reused for another key; announcing by that stale source
    told a router of a key the cache does not hold."""
    m = HybridWriteBackMachine()
    try:
        m.admit(stem=2, extra=[], salt=None)
        for _ in range(4):
            m.grow(pick=0, tok=0, count=1)
        m.admit(stem=2, extra=[], salt=None)
        m.consistent()
        m.events_index_the_cache()
    finally:
        m.teardown()
