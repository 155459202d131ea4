"""The peer book: which peers recently failed to answer or answered late, and how many times in a row each failed.

Kept by the protocol (every reply or silence is recorded here) and read by the crawl, which asks suspect peers but
does not wait for them: a live peer on a busy machine is late too, and skipping it would put records where no
reader looks.
"""
from __future__ import annotations

import time
from itertools import islice

#: consecutive unanswered requests after which a contact is evicted from the routing table
EVICT_AFTER_FAILURES = 3
#: failure counts kept at most (hostile peers cannot grow the book without limit)
MAX_FAILURE_COUNTS = 1 << 16
#: suspects the book keeps at most of each kind (dead, slow). A peer may name any number of made-up contacts that
#: never answer, and a suspect used to be forgotten only when its own id was looked at again, after its time was up.
#: Now those whose time is up are forgotten every ``dead_node_ttl``, and at this many also the oldest half.
MAX_SUSPECTS = 1 << 16


class PeerBook:
    """dead_node_ttl: how long a peer that failed to answer (or answered late) stays suspect, unless it is heard
    from first."""

    def __init__(self, dead_node_ttl: float):
        self.dead_node_ttl = dead_node_ttl
        self._slow_until: dict[bytes, float] = {}  # node id -> monotonic time until which lookups do not wait for it
        self._dead_until: dict[bytes, float] = {}  # node id -> monotonic time until which lookups skip it
        self._failures: dict[bytes, int] = {}  # node id -> consecutive unanswered requests
        self._purge_at = time.monotonic() + dead_node_ttl  # when to forget the suspects whose time is up

    def failed(self, node_id: bytes) -> bool:
        """Records a request the peer left unanswered; True when that makes :data:`EVICT_AFTER_FAILURES` in a row
        (the count then starts again)."""
        now = time.monotonic()
        if self._dead_until.pop(node_id, None) is None:  # (popped: the book forgets the least recent first)
            self._make_room(self._dead_until, now)
        self._dead_until[node_id] = now + self.dead_node_ttl
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
        if node_id not in self._slow_until:
            now = time.monotonic()
            self._make_room(self._slow_until, now)
            self._slow_until[node_id] = now + self.dead_node_ttl

    def _make_room(self, suspects: dict[bytes, float], now: float) -> None:
        """Before a new suspect: every ``dead_node_ttl``, or when ``suspects`` is full, forgets the suspects whose
        time is up; then, if ``suspects`` is still three quarters full, its oldest until half are left (amortised
        O(1) per suspect)."""
        if now < self._purge_at and len(suspects) < MAX_SUSPECTS:
            return
        self._purge_at = now + self.dead_node_ttl
        for book in (self._dead_until, self._slow_until):
            for node_id in [node_id for node_id, until in book.items() if until <= now]:
                del book[node_id]
        if len(suspects) >= MAX_SUSPECTS * 3 // 4:
            for node_id in list(islice(suspects, len(suspects) - MAX_SUSPECTS // 2)):
                del suspects[node_id]

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
