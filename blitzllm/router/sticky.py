"""Which backend holds each stored response of OpenAI's Responses API. ``blitz serve`` keeps a
stored response (``store``, continued by ``previous_response_id``, read by GET / DELETE) in its
own memory, so the router remembers the backend that made each response id (an LRU map, bounded
by a count) and sends what names that id back there. Knows nothing about HTTP.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .backends import Backend

RESPONSE_OWNERS = 100_000   # response ids remembered (LRU); one entry is a short string and a reference


def response_id(obj: dict) -> Optional[str]:
    """The id of a stored response in a backend's answer: a response object, or a streamed event
    that carries one (``response.created``, ``response.completed`` ...); None for anything else,
    and for a response made with ``store`` false (no backend can read it back)."""
    if obj.get("object") != "response":
        inner = obj.get("response")
        if not (isinstance(obj.get("type"), str) and obj["type"].startswith("response.") and isinstance(inner, dict)):
            return None
        obj = inner
    rid = obj.get("id")
    return rid if isinstance(rid, str) and rid and obj.get("store") is not False else None


class ResponseOwners:
    """response id -> the backend that made it, least recently used first out. Touched on the
    event loop only."""

    def __init__(self, max_entries: int = RESPONSE_OWNERS):
        self.max_entries = max_entries
        self._owners: OrderedDict[str, Backend] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def remember(self, rid: str, b: Backend) -> None:
        self._owners[rid] = b
        self._owners.move_to_end(rid)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def owner(self, rid: str) -> Optional[Backend]:
        b = self._owners.get(rid)
        if b is not None:  # (a conversation being continued stays remembered)
            self._owners.move_to_end(rid)
        return b

    def forget(self, rid: str) -> None:
        self._owners.pop(rid, None)
