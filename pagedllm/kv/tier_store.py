"""The second tier: KV blocks on disk, keyed by their chained hash, surviving restarts.
Plain Python, no torch: it moves bytes. The manager decides what goes here and what comes
back; the model runner hands over a block's bytes (buffer objects) and copies them back.

Layout, one file per block: DIR/<fingerprint>/<key>.kvb, written as a temporary file in
the same folder and renamed over its name once complete (rename is atomic on POSIX), so a
reader never sees a half-written block under a key's name, and a SIGKILL mid-write leaves
only a temporary file that the next start removes. The directory is the index: no index
file to keep consistent with the blocks, a restart rebuilds the LRU from the files'
mtimes, and eviction is an unlink. (An mmap'd slab with a slot table would save the file
system's per-file cost, ~1 µs a block here, but needs its own crash-consistent index; a
block is 0.1-1 MiB, so a file each costs nothing measurable. llama.cpp's slot files and
LMCache's local-disk chunks are files too.)

Each file: a header (magic, format version, the engine's fingerprint, the key, payload
length, xxh3-64 of header and payload) and the payload. A block is served only when every
field matches and the checksum holds: a corrupted, truncated or foreign file is skipped
with a warning, removed, and its block recomputed. The fingerprint names the model, dtype,
KV dtype, block size and the pool's layout, so another engine's blocks are never read even
from the same directory (each engine keeps to its own fingerprint's folder). Keys chain
the cache salt, so a block stored under one tenant's salt is never found under another's.

Writes run on one background thread; a block being written is pinned by the manager and
read in place (a full cached block is never written to), or handed over as a copy.
"""
from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"PLKVBLK1"
VERSION = 1
# magic, version, fingerprint (16 bytes), key, payload length, checksum
_HEADER = struct.Struct("<8sI16sQQQ")
SUFFIX = ".kvb"
_TMP = ".tmp-"


@dataclass(slots=True)
class TierStats:
    """The tier's counters (the manager's KVStats carries them)."""
    capacity_bytes: int = 0
    blocks: int = 0               # entries on disk now
    bytes: int = 0                # their bytes, headers included
    written_blocks: int = 0       # writes completed since start
    write_errors: int = 0         # writes that failed (disk full, IO errors): the block stays in the pool only
    evicted_blocks: int = 0       # removed to stay under capacity (LRU)
    read_blocks: int = 0          # blocks read back and verified
    read_failures: int = 0        # corrupt, truncated or foreign files skipped (and removed)


def fingerprint(*parts: object) -> bytes:
    """16 bytes naming what a block's bytes mean: the model, dtypes, block size, layout."""
    return xxhash.xxh3_128_digest("\x00".join(map(str, (VERSION, *parts))).encode())


def _checksum(header: bytes, parts: Sequence) -> int:
    h = xxhash.xxh3_64()
    h.update(header)
    for p in parts:
        h.update(p)
    return h.intdigest()


class TierStore:
    """Blocks of `block_bytes` bytes under 64-bit keys, at most `capacity` bytes on disk,
    least recently used removed first. Thread-safe: the engine reads and queues writes, the
    writer thread writes."""

    def __init__(self, root: str | os.PathLike, capacity: int, fp: bytes, block_bytes: int) -> None:
        if len(fp) != 16:
            raise ValueError("tier fingerprint must be 16 bytes")
        if capacity < block_bytes + _HEADER.size:
            raise ValueError(f"kv_offload_size {capacity} bytes is smaller than one block "
                             f"({block_bytes + _HEADER.size} bytes)")
        self.fp = fp
        self.block_bytes = block_bytes
        self.file_bytes = block_bytes + _HEADER.size
        self.dir = Path(root) / fp.hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {str(root)!r}: cannot create {self.dir}: {e}") from e
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offload_dir {str(root)!r}: {self.dir} is not writable")
        self.stats = TierStats(capacity_bytes=capacity)
        self._lock = threading.Lock()
        self._lru: OrderedDict[int, None] = OrderedDict()   # keys on disk, oldest first
        self._inflight: dict[int, list] = {}                # key -> the parts being written
        self._done: list[tuple[int, bool]] = []             # (key, written) since the last take_done
        self._queue: queue.Queue = queue.Queue()
        self._scan()
        self._writer: threading.Thread | None = None

    # -- start-up ------------------------------------------------------------
    def _scan(self) -> None:
        """The index from the folder: complete files, oldest used first; temporary files
        left by a killed writer go (each process names its own with its pid)."""
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.startswith(_TMP):
                if not _alive(name):
                    _unlink(entry.path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                key = int(name[:-len(SUFFIX)], 16)
                st = entry.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = None
        self.stats.blocks = len(self._lru)
        self.stats.bytes = len(self._lru) * self.file_bytes
        for k in self._evict_over():  # a smaller --kv-offload-size than last time
            _unlink(self.path(k))
        if found:
            logger.info("KV tier %s: %d blocks (%.1f MiB) from an earlier run", self.dir, self.stats.blocks,
                        self.stats.bytes / 2**20)

    def path(self, key: int) -> Path:
        return self.dir / f"{key:016x}{SUFFIX}"

    # -- queries -------------------------------------------------------------
    def __contains__(self, key: int) -> bool:
        """On disk or being written (a lookup's answer; a read still verifies)."""
        return key in self._lru or key in self._inflight

    # -- reads ---------------------------------------------------------------
    def read(self, key: int) -> memoryview | None:
        """The block's payload, verified; None (with a warning, the file removed) when it is
        missing, corrupt, truncated or another engine's."""
        with self._lock:
            parts = self._inflight.get(key)
        if parts is not None:  # still being written: its bytes are at hand
            return memoryview(bytearray().join(parts))
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                buf = bytearray(self.file_bytes + 1)   # writable: the runner's tensors view it
                data = memoryview(buf)[:f.readinto(buf)]
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            return self._bad(key, path, f"cannot be read ({e})")
        why = self._check(key, data)
        if why is not None:
            return self._bad(key, path, why)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
            self.stats.read_blocks += 1
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return data[_HEADER.size:]

    def _check(self, key: int, data: memoryview) -> str | None:
        if len(data) < _HEADER.size:
            return f"truncated ({len(data)} bytes, no header)"
        magic, version, fp, k, length, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            return "not a PagedLLM KV block of this format"
        if fp != self.fp:
            return "written by another model, dtype, block size or KV layout (fingerprint differs)"
        if k != key:
            return f"holds block {k:016x}, not {key:016x}"
        if length != self.block_bytes:
            return f"payload of {length} bytes, a block here has {self.block_bytes}"
        if len(data) != _HEADER.size + length:
            return f"truncated ({len(data) - _HEADER.size} of {length} payload bytes)"
        header = _HEADER.pack(magic, version, fp, k, length, 0)
        if _checksum(header, [data[_HEADER.size:]]) != checksum:
            return "checksum mismatch (corrupted)"
        return None

    def _bad(self, key: int, path: Path, why: str) -> None:
        logger.warning("KV tier: block file %s skipped, its block is recomputed: %s", path, why)
        with self._lock:
            self.stats.read_failures += 1
        self._forget(key)
        _unlink(path)
        return None

    def _forget(self, key: int) -> None:
        with self._lock:
            if self._lru.pop(key, 0) is None:
                self.stats.blocks -= 1
                self.stats.bytes -= self.file_bytes

    # -- writes --------------------------------------------------------------
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
                    ok = self._write(key)
                except Exception:  # never lose the writer: the block stays in the pool only
                    logger.exception("KV tier: writing block %016x failed", key)
                    ok = False
                with self._lock:
                    self._inflight.pop(key, None)
                    self._done.append((key, ok))
            finally:
                self._queue.task_done()

    def _write(self, key: int) -> bool:
        parts = self._inflight[key]
        header = _HEADER.pack(MAGIC, VERSION, self.fp, key, self.block_bytes, 0)
        header = _HEADER.pack(MAGIC, VERSION, self.fp, key, self.block_bytes, _checksum(header, parts))
        final = self.path(key)
        tmp = self.dir / f"{_TMP}{os.getpid()}-{key:016x}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                for p in parts:
                    f.write(p)
            os.replace(tmp, final)
        except OSError as e:
            _unlink(tmp)
            with self._lock:
                self.stats.write_errors += 1
                first = self.stats.write_errors == 1
            (logger.warning if first else logger.debug)("KV tier: block %016x not written: %s", key, e)
            return False
        with self._lock:
            if key not in self._lru:
                self.stats.blocks += 1
                self.stats.bytes += self.file_bytes
            self._lru[key] = None
            self._lru.move_to_end(key)
            self.stats.written_blocks += 1
            victims = self._evict_over()
        for k in victims:
            _unlink(self.path(k))
        return True

    def _evict_over(self) -> list[int]:
        """Drop the least recently used entries until the tier fits its capacity (lock held,
        or at start-up); returns the keys whose files the caller removes."""
        victims = []
        while self._lru and self.stats.bytes > self.stats.capacity_bytes:
            key, _ = self._lru.popitem(last=False)
            victims.append(key)
            self.stats.blocks -= 1
            self.stats.bytes -= self.file_bytes
            self.stats.evicted_blocks += 1
        return victims

    def snapshot(self) -> TierStats:
        with self._lock:
            s = self.stats
            return TierStats(s.capacity_bytes, s.blocks, s.bytes, s.written_blocks, s.write_errors,
                             s.evicted_blocks, s.read_blocks, s.read_failures)


def _alive(tmp_name: str) -> bool:
    """Whether the process that named a temporary file so is still running (it may be writing)."""
    try:
        pid = int(tmp_name[len(_TMP):].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
