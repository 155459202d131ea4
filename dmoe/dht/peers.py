"""The peer book: which peers recently failed to answer or answered late, and how many times in a row each failed.

Kept by the protocol (every reply or silence is recorded here) and read by the crawl, which asks suspect peers but
does not wait for them: a live peer on a busy machine is late too, and skipping it would put records where no
reader looks.

A peer is a node id *at an address* (:func:`peer_key`), not an id: ids cost nothing and nothing binds one to an
address, so any reply may name a live node's id at an address that never answers. Keyed by id, the silence of that
made-up address marked the real node dead for ``dead_node_ttl`` (and, three times over, evicted it) in every later
look-up (review 89).
"""
from __future__ import annotations

import time
from itertools import islice
from typing import Hashable

from kademlia.node import Node

#: consecutive unanswered requests after which a contact is evicted from the routing table
EVICT_AFTER_FAILURES = 3
#: failure counts kept at most (hostile peers cannot grow the book without limit)
MAX_FAILURE_COUNTS = 1 << 16
#: suspects the book keeps at most of each kind (dead, slow). A peer may name any number of made-up contacts that
#: never answer, and a suspect used to be forgotten only when its own id was looked at again, after its time was up.
#: Now those whose time is up are forgotten every ``dead_node_ttl``, and at this many also the oldest half.
MAX_SUSPECTS = 1 << 16

#: how the book (and a crawl) names a peer: its node id, ip and port
Peer = tuple[bytes, str, int]


def peer_key(node: Node) -> Peer:
    """``node`` as the book names it: the id at its address (the same id elsewhere is another peer)."""
    return (node.id, node.ip, node.port)


class PeerBook:
    """dead_node_ttl: how long a peer that failed to answer (or answered late) stays suspect, unless it is heard
    from first.

    Peers are named by :func:`peer_key` (any hashable works: the book only compares them)."""

    def __init__(self, dead_node_ttl: float):
        self.dead_node_ttl = dead_node_ttl
        self._slow_until: dict[Hashable, float] = {}  # peer -> monotonic time until which lookups do not wait for it
        self._dead_until: dict[Hashable, float] = {}  # peer -> monotonic time until which lookups skip it
        self._failures: dict[Hashable, int] = {}  # peer -> consecutive unanswered requests
        self._purge_at = time.monotonic() + dead_node_ttl  # when to forget the suspects whose time is up

    def failed(self, peer: Hashable) -> bool:
        """Records a request the peer left unanswered; True when that makes :data:`EVICT_AFTER_FAILURES` in a row
        (the count then starts again)."""
        now = time.monotonic()
        if self._dead_until.pop(peer, None) is None:  # (popped: the book forgets the least recent first)
            self._make_room(self._dead_until, now)
        self._dead_until[peer] = now + self.dead_node_ttl
        if len(self._failures) >= MAX_FAILURE_COUNTS:
            self._failures.clear()
        failures = self._failures[peer] = self._failures.get(peer, 0) + 1
        if failures >= EVICT_AFTER_FAILURES:
            del self._failures[peer]
            return True
        return False

    def answered(self, peer: Hashable) -> None:
        """Records a reply: the peer's run of failures is over."""
        self._failures.pop(peer, None)

    def heard_from(self, peer: Hashable) -> None:
        """The peer just spoke to us or answered: it is neither dead nor slow any more."""
        self._dead_until.pop(peer, None)
        self._slow_until.pop(peer, None)

    def mark_slow(self, peer: Hashable) -> None:
        """A peer that let a lookup wait past ``hedge_after``: later lookups ask it without waiting for it."""
        if peer not in self._slow_until:
            now = time.monotonic()
            self._make_room(self._slow_until, now)
            self._slow_until[peer] = now + self.dead_node_ttl

    def _make_room(self, suspects: dict[Hashable, float], now: float) -> None:
        """Before a new suspect: every ``dead_node_ttl``, or when ``suspects`` is full, forgets the suspects whose
        time is up; then, if ``suspects`` is still three quarters full, its oldest until half are left (amortised
        O(1) per suspect)."""
        if now < self._purge_at and len(suspects) < MAX_SUSPECTS:
            return
        self._purge_at = now + self.dead_node_ttl
        for book in (self._dead_until, self._slow_until):
            for peer in [peer for peer, until in book.items() if until <= now]:
                del book[peer]
        if len(suspects) >= MAX_SUSPECTS * 3 // 4:
            for peer in list(islice(suspects, len(suspects) - MAX_SUSPECTS // 2)):
                del suspects[peer]

    def may_be_suspect(self, peer: Hashable) -> bool:
        """False for a peer neither :meth:`recently_dead` nor :meth:`recently_slow` (cheaply: no clock read)."""
        return peer in self._dead_until or peer in self._slow_until

    def recently_slow(self, peer: Hashable) -> bool:
        until = self._slow_until.get(peer)
        if until is not None and until <= time.monotonic():
            del self._slow_until[peer]
            return False
        return until is not None

    def recently_dead(self, peer: Hashable) -> bool:
        """True for a peer that failed to answer within ``dead_node_ttl`` and has not been heard from since."""
        until = self._dead_until.get(peer)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._dead_until[peer]
            return False
        return True
