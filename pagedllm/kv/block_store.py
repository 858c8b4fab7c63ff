"""What every store of the second tier shares: a block's sealed form and the writer thread.

A stored block is a header (magic, format version, the engine's fingerprint, the key,
payload length, xxh3-64 of header and payload) and the payload. A block is served only when
every field matches and the checksum holds (`check`): a corrupted, truncated or foreign
entry is skipped and its block recomputed. The fingerprint names the model, dtype, KV dtype,
block size and the pool's layout, so another engine's blocks are never read even from the
same place; keys chain the tenant's cache salt, so a block stored under one tenant's salt is
never found under another's.

QueuedStore: put() hands a block's bytes to one background thread that writes them
(a store's `_write`); a block being written is pinned by the manager and read in place, or
handed over as a copy, and reads of it are served from those bytes until it is written.
"""
from __future__ import annotations

import logging
import queue
import struct
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"PLKVBLK1"
VERSION = 1
# magic, version, fingerprint (16 bytes), key, payload length, checksum
HEADER = struct.Struct("<8sI16sQQQ")


@dataclass(slots=True)
class TierStats:
    """The tier's counters (the manager's KVStats carries them)."""
    capacity_bytes: int = 0
    blocks: int = 0               # entries now (a shared store: those this engine knows of)
    bytes: int = 0                # their bytes, headers included
    written_blocks: int = 0       # writes completed since start
    write_errors: int = 0         # writes that failed (disk full, IO errors): the block stays in the pool only
    evicted_blocks: int = 0       # removed to stay under capacity (LRU)
    read_blocks: int = 0          # blocks read back and verified
    read_failures: int = 0        # corrupt, truncated, foreign or unreadable entries skipped (and removed)


def fingerprint(*parts: object) -> bytes:
    """16 bytes naming what a block's bytes mean: the model, dtypes, block size, layout."""
    return xxhash.xxh3_128_digest("\x00".join(map(str, (VERSION, *parts))).encode())


def _checksum(header: bytes, parts: Iterable) -> int:
    h = xxhash.xxh3_64()
    h.update(header)
    for p in parts:
        h.update(p)
    return h.intdigest()


def seal(fp: bytes, key: int, block_bytes: int, parts: Sequence) -> bytes:
    """The header that goes before a block's payload (`parts`, concatenated)."""
    header = HEADER.pack(MAGIC, VERSION, fp, key, block_bytes, 0)
    return HEADER.pack(MAGIC, VERSION, fp, key, block_bytes, _checksum(header, parts))


def check(fp: bytes, key: int, block_bytes: int, data: memoryview) -> str | None:
    """Why `data` (header and payload) is not block `key` of this fingerprint; None if it is."""
    if len(data) < HEADER.size:
        return f"truncated ({len(data)} bytes, no header)"
    magic, version, their_fp, k, length, checksum = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        return "not a PagedLLM KV block of this format"
    if their_fp != fp:
        return "written by another model, dtype, block size or KV layout (fingerprint differs)"
    if k != key:
        return f"holds block {k:016x}, not {key:016x}"
    if length != block_bytes:
        return f"payload of {length} bytes, a block here has {block_bytes}"
    if len(data) != HEADER.size + length:
        return f"truncated ({len(data) - HEADER.size} of {length} payload bytes)"
    header = HEADER.pack(magic, version, their_fp, k, length, 0)
    if _checksum(header, [data[HEADER.size:]]) != checksum:
        return "checksum mismatch (corrupted)"
    return None


class QueuedStore(ABC):
    """Blocks of `block_bytes` bytes under 64-bit keys, written by one background thread.
    Thread-safe: the engine reads and queues writes, the writer thread writes."""

    def __init__(self, fp: bytes, block_bytes: int, stats: TierStats) -> None:
        if len(fp) != 16:
            raise ValueError("tier fingerprint must be 16 bytes")
        self.fp, self.block_bytes, self.stats = fp, block_bytes, stats
        self.entry_bytes = block_bytes + HEADER.size
        self._lock = threading.Lock()
        self._inflight: dict[int, list] = {}                # key -> the parts being written
        self._done: list[tuple[int, bool]] = []             # (key, written) since the last take_done
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None

    @abstractmethod
    def _write(self, key: int, parts: list) -> bool:
        """Store one block (on the writer thread); False if it could not be (counted, logged)."""

    def _being_written(self, key: int) -> memoryview | None:
        """A block still being written: its bytes are at hand (a writable copy)."""
        with self._lock:
            parts = self._inflight.get(key)
        return memoryview(bytearray().join(parts)) if parts is not None else None

    def have(self, keys: Sequence[int]) -> set[int]:
        """Which of `keys` the store holds or is writing (one question, however many keys)."""
        return {k for k in keys if k in self}

    @abstractmethod
    def read(self, key: int) -> memoryview | None:
        """The block's payload, verified; None when the store cannot serve it."""

    def read_many(self, keys: Sequence[int]) -> list[memoryview | None]:
        """read() of each key, in order (a networked store asks for all of them at once)."""
        return [self.read(k) for k in keys]

    def put(self, key: int, parts: Sequence) -> None:
        """Queue a block's bytes (buffer objects, concatenated in order) for writing; they
        must stay unchanged until take_done() reports the key."""
        size = sum(memoryview(p).nbytes for p in parts)
        if size != self.block_bytes:
            raise ValueError(f"KV tier: a block of {size} bytes, expected {self.block_bytes}")
        with self._lock:
            if key in self._inflight:  # the same block twice in flight (saved, then recomputed): one write
                return
            self._inflight[key] = list(parts)
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
                self._writer.start()
        self._queue.put(key)

    def take_done(self) -> list[tuple[int, bool]]:
        """(key, written) for each write finished since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def flush(self) -> None:
        """Wait until every queued write has finished."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer (a later put starts it again)."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._writer = None

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                try:
                    ok = self._write(key, self._inflight[key])
                except Exception:  # never lose the writer: the block stays in the pool only
                    logger.exception("KV tier: writing block %016x failed", key)
                    ok = False
                with self._lock:
                    self._inflight.pop(key, None)
                    self._done.append((key, ok))
            finally:
                self._queue.task_done()

    def _write_failed(self, key: int, why: object) -> bool:
        """Count a failed write; the first is a warning (the block stays in the pool only)."""
        with self._lock:
            self.stats.write_errors += 1
            first = self.stats.write_errors == 1
        (logger.warning if first else logger.debug)("KV tier: block %016x not written: %s", key, why)
        return False

    def snapshot(self) -> TierStats:
        with self._lock:
            s = self.stats
            return TierStats(s.capacity_bytes, s.blocks, s.bytes, s.written_blocks, s.write_errors,
                             s.evicted_blocks, s.read_blocks, s.read_failures)
