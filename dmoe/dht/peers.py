"""The peer book: which peers recently failed to answer or answered late, and how many times in a row each failed.

Kept by the protocol (every reply or silence is recorded here) and read by the crawl, which asks suspect peers but
does not wait for them: a live peer on a busy machine is late too, and skipping it would put records where no
reader looks.
"""
from __future__ import annotations

import time

#: consecutive unanswered requests after which a contact is evicted from the routing table
EVICT_AFTER_FAILURES = 3
#: failure counts kept at most (hostile peers cannot grow the book without limit)
MAX_FAILURE_COUNTS = 1 << 16


class PeerBook:
    """dead_node_ttl: how long a peer that failed to answer (or answered late) stays suspect, unless it is heard
    from first."""

    def __init__(self, dead_node_ttl: float):
        self.dead_node_ttl = dead_node_ttl
        self._slow_until: dict[bytes, float] = {}  # node id -> monotonic time until which lookups do not wait for it
        self._dead_until: dict[bytes, float] = {}  # node id -> monotonic time until which lookups skip it
        self._failures: dict[bytes, int] = {}  # node id -> consecutive unanswered requests

    def failed(self, node_id: bytes) -> bool:
        """Records a request the peer left unanswered; True when that makes :data:`EVICT_AFTER_FAILURES` in a row
        (the count then starts again)."""
        self._dead_until[node_id] = time.monotonic() + self.dead_node_ttl
        if len(self._failures) >= MAX_FAILURE_COUNTS:
            self._failures.clear()
        failures = self._failures[node_id] = self._failures.get(node_id, 0) + 1
        if failures >= EVICT_AFTER_FAILURES:
            del self._failures[node_id]
            return True
        return False

    def answered(self, node_id: bytes) -> None:
        """Records a reply: the peer's run of failures is over."""
        self._failures.pop(node_id, None)

    def heard_from(self, node_id: bytes) -> None:
        """The peer just spoke to us or answered: it is neither dead nor slow any more."""
        self._dead_until.pop(node_id, None)
        self._slow_until.pop(node_id, None)

    def mark_slow(self, node_id: bytes) -> None:
        """A peer that let a lookup wait past ``hedge_after``: later lookups ask it without waiting for it."""
        self._slow_until.setdefault(node_id, time.monotonic() + self.dead_node_ttl)

    def may_be_suspect(self, node_id: bytes) -> bool:
        """False for a peer neither :meth:`recently_dead` nor :meth:`recently_slow` (cheaply: no clock read)."""
        return node_id in self._dead_until or node_id in self._slow_until

    def recently_slow(self, node_id: bytes) -> bool:
        until = self._slow_until.get(node_id)
        if until is not None and until <= time.monotonic():
            del self._slow_until[node_id]
            return False
        return until is not None

    def recently_dead(self, node_id: bytes) -> bool:
        """True for a peer that failed to answer within ``dead_node_ttl`` and has not been heard from since."""
        until = self._dead_until.get(node_id)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._dead_until[node_id]
            return False
        return True
