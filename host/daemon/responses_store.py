"""Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (`store: true`): per API
key, the most recently used first, at most `max_per_key` of them and `max_bytes_per_key` of
their JSON; past a bound the least recently used goes. One key never sees another's.

Pure bookkeeping, used from the event loop only (no lock).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_PER_KEY = 64
MAX_BYTES_PER_KEY = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was answered
    history: list[dict[str, Any]]  # the conversation as chat messages, this response's output last
    size_bytes: int


class ResponseStore:
    def __init__(self, max_per_key: int = MAX_PER_KEY, max_bytes_per_key: int = MAX_BYTES_PER_KEY) -> None:
        self._max_per_key = max_per_key
        self._max_bytes = max_bytes_per_key
        self._by_key: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}

    def put(self, key: str, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(history))
        if size > self._max_bytes:
            return  # it alone would push out everything the key keeps
        kept = self._by_key.setdefault(key, OrderedDict())
        old = kept.pop(response["id"], None)
        total = self._bytes.get(key, 0) - (old.size_bytes if old else 0) + size
        kept[response["id"]] = StoredResponse(response, history, size)
        while len(kept) > self._max_per_key or total > self._max_bytes:
            _, dropped = kept.popitem(last=False)
            total -= dropped.size_bytes
        self._bytes[key] = total

    def get(self, key: str, response_id: str) -> StoredResponse | None:
        kept = self._by_key.get(key)
        if kept is None or response_id not in kept:
            return None
        kept.move_to_end(response_id)
        return kept[response_id]

    def delete(self, key: str, response_id: str) -> bool:
        kept = self._by_key.get(key)
        if kept is None or response_id not in kept:
            return False
        self._bytes[key] -= kept.pop(response_id).size_bytes
        return True

    def count(self, key: str) -> int:
        return len(self._by_key.get(key, ()))
