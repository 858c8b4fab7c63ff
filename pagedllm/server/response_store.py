"""Stored responses, for the Responses API's `previous_response_id`: a conversation goes on
from a response the server kept, as OpenAI's does with `store: true`.

Each tenant (API key) has its own store of at most `per_tenant` responses and
`bytes_per_tenant` of their JSON, least recently used first out: one tenant's traffic never evicts another's, and no tenant reads, continues
or deletes another's response (it is not found, as an id that was never made)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]       # the Response object as it was returned
    messages: list[dict[str, Any]]  # the conversation as chat messages, its answer included (no instructions)
    nbytes: int                     # its size as JSON, counted against the tenant's bytes


class ResponseStore:
    def __init__(self, per_tenant: int, bytes_per_tenant: int = 64 << 20) -> None:
        if per_tenant < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {per_tenant}")
        self.per_tenant, self.bytes_per_tenant = per_tenant, bytes_per_tenant
        self._by_tenant: dict[str | None, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str | None, int] = {}
        self._lock = threading.Lock()   # put on the event loop, read on the worker threads

    @property
    def enabled(self) -> bool:
        return self.per_tenant > 0

    def put(self, tenant: str | None, rid: str, stored: StoredResponse) -> bool:
        """Keep it (False: the store is off, or it alone is over the tenant's bytes)."""
        if not self.enabled or stored.nbytes > self.bytes_per_tenant:
            return False
        with self._lock:
            own = self._by_tenant.setdefault(tenant, OrderedDict())
            own[rid] = stored
            self._bytes[tenant] = self._bytes.get(tenant, 0) + stored.nbytes
            while len(own) > self.per_tenant or self._bytes[tenant] > self.bytes_per_tenant:
                self._bytes[tenant] -= own.popitem(last=False)[1].nbytes
        return True

    def get(self, tenant: str | None, rid: str) -> StoredResponse | None:
        with self._lock:
            own = self._by_tenant.get(tenant)
            if own is None or rid not in own:
                return None
            own.move_to_end(rid)
            return own[rid]

    def delete(self, tenant: str | None, rid: str) -> bool:
        with self._lock:
            gone = self._by_tenant.get(tenant, {}).pop(rid, None)
            if gone is not None:
                self._bytes[tenant] -= gone.nbytes
            return gone is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._by_tenant.values()))
