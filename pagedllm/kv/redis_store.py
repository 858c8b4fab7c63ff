"""The second tier on Redis or Valkey: one store that every engine of the same model shares.

What LMCache's remote backend and Mooncake's store do for vLLM, on a store built for it: a
block computed by one replica is served to any other that points at the same server (or
cluster proxy), so a prefix is prefilled once per fleet, not once per replica. Plain
Python, no torch: it moves bytes.

Layout: one string value per block, under `pagedllm:kv:<fingerprint hex>:<key hex>`, holding
the sealed block (block_store: header, checksum, fingerprint, key, then the payload). So:
- another model's, dtype's or block size's blocks live under another prefix, and a value
  that is wrong anyway (overwritten, truncated, flipped) fails its check, is deleted and
  its block recomputed: never served;
- keys chain the tenant's cache salt: a tenant finds only the blocks of its own salt;
- capacity and eviction are the server's (`maxmemory` with `allkeys-lru`, as a cache is
  run): a block the server dropped is a miss, recomputed. With `noeviction` a full server
  refuses writes; they are counted as write errors and the blocks stay in the pool only.

Requests: `have` asks for many keys in one pipelined round trip (a prefix lookup), and a hit's
reads go in pipelines of GETs of a few MiB each (`read_many`); writes go through the background writer
(block_store.QueuedStore). A store that is down or slow costs each call at most `timeout` seconds
and is treated as empty: the engine keeps running on its pool and recomputes.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis

from .block_store import HEADER, QueuedStore, TierStats, check, seal

logger = logging.getLogger(__name__)

NAMESPACE = "pagedllm:kv"
RETRY_AFTER = 5.0   # seconds a store that failed is left alone before it is asked again
KNOWN_CAP = 1 << 20  # keys remembered as present (~100 MiB at most); past it, asked again
# How long a key this engine wrote or read stays a hint that the store holds it, for the write
# path's per-block question (a round trip each otherwise). A prefix lookup (`have`) always asks the
# server and drops the hint of every key it lacks: after a restart, flush or eviction a request's
# lookup clears the hints of its blocks, and they are written again when computed.
KNOWN_TTL = 30.0
# Bytes of values one pipeline of a read asks for: a prefix hit's blocks go in pipelines of this
# many bytes, a round trip each. One pipeline for 188 blocks of 368 KiB (69 MiB) took 1.2x the
# time of a GET each on loopback (redis-py parses a long pending reply slowly); pipelines of 8-16
# such blocks took 0.87-0.94x of it, and across hosts save a network round trip for all but one
# block in each.
READ_BATCH_BYTES = 4 << 20


def client_url(url: str) -> str:
    """valkey:// speaks Redis's protocol: the client takes it as redis://."""
    for scheme, same in (("valkeys://", "rediss://"), ("valkey://", "redis://")):
        if url.startswith(scheme):
            return same + url[len(scheme):]
    return url


class RedisStore(QueuedStore):
    def __init__(self, url: str, fp: bytes, block_bytes: int, timeout: float = 2.0) -> None:
        super().__init__(fp, block_bytes, TierStats())
        self.url = url
        self.prefix = f"{NAMESPACE}:{fp.hex()}:".encode()
        try:
            self.client = redis.Redis.from_url(client_url(url), socket_timeout=timeout,
                                               socket_connect_timeout=timeout)
            self.client.ping()
            info = self.client.info("memory")
        except (redis.RedisError, ValueError, OSError) as e:
            raise ValueError(f"kv_offload_url {url!r}: cannot reach the store: {e}") from None
        self.stats.capacity_bytes = int(info.get("maxmemory", 0) or 0)
        policy = info.get("maxmemory_policy", "")
        if self.stats.capacity_bytes and policy == "noeviction":
            logger.warning("KV tier %s: maxmemory %d bytes with noeviction: writes fail once it is full "
                           "(a cache is run with maxmemory-policy allkeys-lru)", url, self.stats.capacity_bytes)
        self._known: dict[int, float] = {}   # keys this engine wrote or read back -> when: hints (KNOWN_TTL)
        self._down_until = 0.0

    def name(self, key: int) -> bytes:
        return self.prefix + f"{key:016x}".encode()

    # -- a store that fails is left alone a while ------------------------------
    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        first = self._down_until == 0.0
        self._down_until = time.monotonic() + RETRY_AFTER
        (logger.warning if first else logger.debug)(
            "KV tier %s: %s failed (%s); served from the pool alone for %.0f s", self.url, what, e, RETRY_AFTER)

    # -- queries -------------------------------------------------------------
    def __contains__(self, key: int) -> bool:
        """Whether to take the store as holding it (the write path's question): a fresh hint, else
        the server's answer."""
        with self._lock:
            seen = self._known.get(key)
            if key in self._inflight or (seen is not None and time.monotonic() - seen < KNOWN_TTL):
                return True
        return bool(self.have([key]))

    def have(self, keys: Sequence[int]) -> set[int]:
        """The keys being written, and those the store holds now, in one pipelined round trip.
        What this engine wrote or read before is no answer: the server may since have restarted
        empty, been flushed or evicted them (a block it lost is written again when next computed,
        as LMCache and any Redis client treat a missing key: a miss)."""
        with self._lock:
            found = {k for k in keys if k in self._inflight}
        ask = [k for k in keys if k not in found]
        if not ask or not self._up():
            return found
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in ask:
                pipe.exists(self.name(k))
            answers = pipe.execute()
        except redis.RedisError as e:
            self._failed("a lookup", e)
            return found
        with self._lock:
            for k, n in zip(ask, answers):
                if n:
                    found.add(k)
                    self._remember(k)
                else:
                    self._known.pop(k, None)
        return found

    # -- reads ---------------------------------------------------------------
    def read(self, key: int) -> memoryview | None:
        """The block's payload, verified; None (with a warning, the value deleted) when it is
        missing, wrong or the store cannot be reached."""
        return self.read_many([key])[0]

    def read_many(self, keys: Sequence[int]) -> list[memoryview | None]:
        """read() of each key, those not being written asked for in pipelines of READ_BATCH_BYTES
        (a GET each is a network round trip each across hosts)."""
        out = [self._being_written(k) for k in keys]
        ask = [i for i, data in enumerate(out) if data is None]
        per = max(1, READ_BATCH_BYTES // self.entry_bytes)
        for lo in range(0, len(ask), per):
            if not self._up():
                break
            part = ask[lo:lo + per]
            try:
                pipe = self.client.pipeline(transaction=False)
                for i in part:
                    pipe.get(self.name(keys[i]))
                raws = pipe.execute()
            except redis.RedisError as e:
                self._failed("a read", e)
                break
            for i, raw in zip(part, raws):
                out[i] = self._verified(keys[i], raw)
        return out

    def _verified(self, key: int, raw: bytes | None) -> memoryview | None:
        """A GET's value as a payload, checked; None (the value deleted) when wrong or missing."""
        if raw is None:   # the server evicted it, or another engine's check deleted it
            self._forget(key)
            return None
        data = memoryview(bytearray(raw))   # writable: the runner's tensors view it
        why = check(self.fp, key, self.block_bytes, data)
        if why is not None:
            logger.warning("KV tier %s: block %016x skipped, its block is recomputed: %s", self.url, key, why)
            with self._lock:
                self.stats.read_failures += 1
            self._forget(key)
            try:
                self.client.delete(self.name(key))
            except redis.RedisError:
                pass
            return None
        with self._lock:
            self._remember(key)
            self.stats.read_blocks += 1
        return data[HEADER.size:]

    def _remember(self, key: int) -> None:
        """(lock held) A key seen present; the set starts over at its cap."""
        if len(self._known) >= KNOWN_CAP:
            self._known.clear()
        self._known[key] = time.monotonic()

    def _forget(self, key: int) -> None:
        with self._lock:
            self._known.pop(key, None)

    # -- writes --------------------------------------------------------------
    def _write(self, key: int, parts: list) -> bool:
        value = seal(self.fp, key, self.block_bytes, parts) + b"".join(parts)
        try:
            self.client.set(self.name(key), value)
        except redis.RedisError as e:
            return self._write_failed(key, e)
        with self._lock:
            self._remember(key)
            self.stats.written_blocks += 1
        return True

    def snapshot(self) -> TierStats:
        """The counters; blocks and bytes are those this engine knows the store holds (a shared
        server's total is its own)."""
        s = super().snapshot()
        with self._lock:
            s.blocks = len(self._known)
        s.bytes = s.blocks * self.entry_bytes
        return s

    def close(self) -> None:
        super().close()
        self.client.close()
