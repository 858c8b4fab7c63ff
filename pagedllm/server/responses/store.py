"""Stored responses, for the Responses API's `previous_response_id`: a conversation goes on
from a response the server kept, as OpenAI's does with `store: true`.

Each tenant (API key) has its own store of at most `per_tenant` responses and
`bytes_per_tenant` of their records, counted whole (the Response as returned, with its metadata,
tools, instructions and schema, and the conversation kept to continue it), oldest first out; and
the server holds at most `bytes_total` in all. One tenant's traffic never evicts another's: where
the others' records fill the total, the new one is refused (put says so, and the response says
`store: false`). No tenant reads, continues or deletes another's response (it is not found, as an
id that was never made)."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]       # the Response object as it was returned
    messages: list[dict[str, Any]]  # the conversation as chat messages, its answer included (no instructions)
    nbytes: int                     # the whole record's size as JSON, counted against the caps

    @classmethod
    def of(cls, response: dict[str, Any], messages: list[dict[str, Any]]) -> StoredResponse:
        """A record, measured whole: everything it keeps, as JSON."""
        nbytes = len(json.dumps({"response": response, "messages": messages}, ensure_ascii=False).encode())
        return cls(response, messages, nbytes)


class ResponseStore:
    def __init__(self, per_tenant: int, bytes_per_tenant: int = 64 << 20, bytes_total: int = 512 << 20) -> None:
        if per_tenant < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {per_tenant}")
        self.per_tenant, self.bytes_per_tenant, self.bytes_total = per_tenant, bytes_per_tenant, bytes_total
        self._by_tenant: dict[str | None, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str | None, int] = {}
        self._total = 0
        self._lock = threading.Lock()   # put on the event loop, read on the worker threads

    @property
    def enabled(self) -> bool:
        return self.per_tenant > 0

    def put(self, tenant: str | None, rid: str, stored: StoredResponse) -> bool:
        """Keep it, the tenant's own oldest records out first as its caps and the total need
        (False: the store is off, the record alone is over a cap, or the other tenants' records
        fill the total)."""
        n = stored.nbytes
        if not self.enabled or n > self.bytes_per_tenant or n > self.bytes_total:
            return False
        with self._lock:
            if self._total - self._bytes.get(tenant, 0) + n > self.bytes_total:
                return False   # the others' records fill the total: dropping this tenant's own would not make room
            own = self._by_tenant.setdefault(tenant, OrderedDict())
            while own and (len(own) >= self.per_tenant or self._bytes.get(tenant, 0) + n > self.bytes_per_tenant
                           or self._total + n > self.bytes_total):
                self._drop(tenant, next(iter(own)))
            own[rid] = stored
            self._bytes[tenant] = self._bytes.get(tenant, 0) + n
            self._total += n
        return True

    def _drop(self, tenant: str | None, rid: str) -> StoredResponse | None:
        gone = self._by_tenant.get(tenant, {}).pop(rid, None)
        if gone is not None:
            self._bytes[tenant] -= gone.nbytes
            self._total -= gone.nbytes
        return gone

    def bytes_held(self, tenant: str | None = None, everyone: bool = False) -> int:
        with self._lock:
            return self._total if everyone else self._bytes.get(tenant, 0)

    def get(self, tenant: str | None, rid: str) -> StoredResponse | None:
        with self._lock:
            return self._by_tenant.get(tenant, {}).get(rid)

    def delete(self, tenant: str | None, rid: str) -> bool:
        with self._lock:
            return self._drop(tenant, rid) is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._by_tenant.values()))
