"""The stored responses of ``/v1/responses`` (``store``, ``previous_response_id``, GET and DELETE):
in memory, least recently used first out, bounded by a count (``--max-stored-responses``) and by
a size budget, so no client can grow the server without limit. Each entry keeps the response
body and its conversation (the earlier turns' items, its input items, its output items) as item
dicts; a continuation shares the earlier items (a new list of the same dicts), and is charged
for the whole conversation, so the budget is an over-estimate, never an under-estimate."""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Optional

# characters of JSON over all entries, each charged its whole conversation: a constant, as the
# count (--max-stored-responses) is what users tune; this only stops a few huge conversations
# from holding gigabytes (a 1024-entry store of 8 MiB bodies would)
MAX_STORED_CHARS = 256 << 20


class StoredResponse:
    __slots__ = ("response", "conversation", "chars")

    def __init__(self, response: dict, conversation: list, chars: int):
        self.response, self.conversation, self.chars = response, conversation, chars


def json_chars(obj) -> int:
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


class ResponseStore:
    """Touched on the event loop only (no locks); ``entry`` (the size counting) may run in a
    worker thread."""

    def __init__(self, max_entries: int, max_chars: int = MAX_STORED_CHARS):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    @staticmethod
    def entry(response: dict, earlier: Optional[StoredResponse], items: list) -> StoredResponse:
        """The entry of ``response``: the conversation it continued (``earlier``), then ``items``
        (its input items and its output)."""
        before = earlier.conversation if earlier is not None else []
        chars = (earlier.chars if earlier is not None else 0) + json_chars(response) + json_chars(items)
        return StoredResponse(response, before + items, chars)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep ``entry`` (False when it alone is over the budget), then drop the least recently
        used entries until the store is within its bounds."""
        if not self.enabled or entry.chars > self.max_chars:
            return False
        self.delete(response_id)
        self._entries[response_id] = entry
        self._chars += entry.chars
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            _, old = self._entries.popitem(last=False)
            self._chars -= old.chars
        return True

    def delete(self, response_id: str) -> bool:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._chars -= old.chars
        return old is not None
