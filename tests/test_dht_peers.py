"""The peer book: silences are counted until eviction, a reply or a message clears suspicion, suspicion expires."""
from __future__ import annotations

import time

from dmoe.dht import peers
from dmoe.dht.peers import EVICT_AFTER_FAILURES, PeerBook

PEER, OTHER = b"p" * 20, b"o" * 20


def test_a_peer_is_evicted_only_after_several_silences_in_a_row():
    book = PeerBook(dead_node_ttl=30.0)
    assert [book.failed(PEER) for _ in range(EVICT_AFTER_FAILURES)] == [False] * (EVICT_AFTER_FAILURES - 1) + [True]
    assert not book.failed(PEER), "the count did not start again after an eviction"
    book.answered(PEER)  # one reply ends the run
    assert not any(book.failed(PEER) for _ in range(EVICT_AFTER_FAILURES - 1))
    assert book.recently_dead(PEER) and not book.recently_dead(OTHER)


def test_suspicion_ends_when_the_peer_is_heard_from_or_its_time_is_up():
    book = PeerBook(dead_node_ttl=30.0)
    book.failed(PEER)
    book.mark_slow(OTHER)
    assert book.may_be_suspect(PEER) and book.recently_dead(PEER) and not book.recently_slow(PEER)
    assert book.may_be_suspect(OTHER) and book.recently_slow(OTHER) and not book.recently_dead(OTHER)
    book.heard_from(PEER)
    book.heard_from(OTHER)
    assert not book.may_be_suspect(PEER) and not book.may_be_suspect(OTHER)
    short = PeerBook(dead_node_ttl=0.05)
    short.failed(PEER)
    short.mark_slow(OTHER)
    deadline = time.monotonic() + 5
    while (short.recently_dead(PEER) or short.recently_slow(OTHER)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not short.recently_dead(PEER) and not short.recently_slow(OTHER)
    assert not short.may_be_suspect(PEER) and not short.may_be_suspect(OTHER)  # forgotten once seen expired


def test_the_suspects_of_made_up_contacts_are_bounded_and_forgotten_once_their_time_is_up(monkeypatch):
    """A hostile peer names fresh ids that never answer in every reply; each one stayed in the book for as long as
    the node ran (only its own id, looked at again, removed it), ~20 more per lookup that reached the peer."""
    monkeypatch.setattr(peers, "MAX_SUSPECTS", 64, raising=False)
    book = PeerBook(dead_node_ttl=30.0)
    for index in range(1000):
        book.failed(index.to_bytes(20, "big"))
        book.mark_slow((index + 5000).to_bytes(20, "big"))
        assert len(book._dead_until) <= 64 and len(book._slow_until) <= 64
    newest = (999).to_bytes(20, "big")
    assert book.recently_dead(newest) and book.recently_slow((5999).to_bytes(20, "big"))  # the newest are kept
    short = PeerBook(dead_node_ttl=0.05)
    for index in range(50):
        short.failed(index.to_bytes(20, "big"))
        short.mark_slow(index.to_bytes(20, "big"))
    time.sleep(0.1)
    short.failed(PEER)  # the first suspect after their time is up: the others are forgotten
    assert list(short._dead_until) == [PEER] and not short._slow_until
