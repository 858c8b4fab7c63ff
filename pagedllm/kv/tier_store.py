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

Each file is a sealed block (block_store: header, checksum, fingerprint, key): a corrupted,
truncated or foreign file is skipped with a warning, removed, and its block recomputed. Each
engine keeps to its own fingerprint's folder. Writes run on the store's background thread.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from .block_store import HEADER, QueuedStore, TierStats, check, fingerprint, seal

__all__ = ["SUFFIX", "TierStats", "TierStore", "fingerprint"]

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TMP = ".tmp-"


class TierStore(QueuedStore):
    """Blocks of `block_bytes` bytes under 64-bit keys in files, at most `capacity` bytes on
    disk, least recently used removed first."""

    def __init__(self, root: str | os.PathLike, capacity: int, fp: bytes, block_bytes: int) -> None:
        if capacity < block_bytes + HEADER.size:
            raise ValueError(f"kv_offload_size {capacity} bytes is smaller than one block "
                             f"({block_bytes + HEADER.size} bytes)")
        super().__init__(fp, block_bytes, TierStats(capacity_bytes=capacity))
        self.file_bytes = self.entry_bytes
        self.dir = Path(root) / fp.hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {str(root)!r}: cannot create {self.dir}: {e}") from e
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offload_dir {str(root)!r}: {self.dir} is not writable")
        self._lru: OrderedDict[int, None] = OrderedDict()   # keys on disk, oldest first
        self._scan()

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
        data = self._being_written(key)
        if data is not None:
            return data
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
        why = check(self.fp, key, self.block_bytes, data)
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
        return data[HEADER.size:]

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
    def _write(self, key: int, parts: list) -> bool:
        header = seal(self.fp, key, self.block_bytes, parts)
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
            return self._write_failed(key, e)
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
