"""A producer's leases: the blocks of finished prefills held for a consumer to pull. A lease is
*held* until a consumer claims it (or ``kv_lease_s`` passes), *claimed* while the consumer reads
(bounded by twice the transfer timeout), and *released* once the read is done or the router
gives up on it. The HTTP thread claims and releases; only the engine thread frees blocks
(``sweep``). Thread-safe; knows nothing about tensors or transports.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional


@dataclass
class Lease:
    lease_id: str
    block_ids: list
    num_tokens: int
    deadline: float
    state: str = "held"   # held | claimed | released


class LeaseTable:
    def __init__(self, lease_s: float, claim_s: float):
        self.lease_s, self.claim_s = lease_s, claim_s
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.expired = 0    # leases freed unclaimed (or never read) after their deadline
        self.completed = 0  # leases released by their consumer

    def add(self, lease_id: str, block_ids: list, num_tokens: int) -> None:
        with self._lock:
            self._leases[lease_id] = Lease(lease_id, list(block_ids), num_tokens, time.monotonic() + self.lease_s)

    def claim(self, lease_id: str) -> Optional[Lease]:
        """The lease, now claimed; None when it is unknown, expired, released or claimed already."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.state != "held" or time.monotonic() > lease.deadline:
                return None
            lease.state, lease.deadline = "claimed", time.monotonic() + self.claim_s
            return lease

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.state == "released":
                return False
            lease.state = "released"
            return True

    def sweep(self) -> list[str]:
        """Ids of the leases to free now (released, or past their deadline), removed from the table."""
        now = time.monotonic()
        with self._lock:
            out = [lid for lid, lease in self._leases.items() if lease.state == "released" or now > lease.deadline]
            for lid in out:
                if self._leases.pop(lid).state == "released":
                    self.completed += 1
                else:
                    self.expired += 1
        return out

    def __len__(self) -> int:
        return len(self._leases)
