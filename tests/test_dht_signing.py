"""In-process checks of signed records: identities, signatures, the ownership rules nodes enforce, how clients
merge what replicas send, and the limits that keep a node alive under junk and floods."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import struct
import time

import pytest
import umsgpack
from kademlia.node import Node

from dmoe.dht.config import DHTConfig
from dmoe.dht.messages import MalformedRequest, find_value_reply, parse_find_value_reply, record_to_wire
from dmoe.dht.protocol import DHTProtocol
from dmoe.dht.signing import Identity, Verifier, verify
from dmoe.dht.storage import MAX_CLOCK_SKEW, Entry, NotOwner, RecordFull, RecordStorage, merge_records
from dmoe.dht.throttle import ThrottledWarnings

KEY, OTHER_KEY = b"k" * 20, b"o" * 20
ALICE, MALLORY = Identity(), Identity()


def test_an_identity_persists_in_its_key_file_and_a_broken_file_is_refused(tmp_path):
    path = tmp_path / "sub" / "id.key"
    created = Identity.load_or_create(path)
    assert Identity.load_or_create(path).public_key == created.public_key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(created.public_key) == 32 and len(created.sign(KEY, 1, "a:1", 5.0)) == 64
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="32-byte"):
        Identity.load_or_create(path)


def test_a_signature_covers_the_record_key_subkey_kind_value_and_expiration():
    entry = ALICE.entry(KEY, 3, "a:1", 100.0)
    assert verify(KEY, 3, *entry)
    assert not verify(OTHER_KEY, 3, *entry), "moved to another record"
    assert not verify(KEY, 4, *entry), "moved to another subkey"
    assert not verify(KEY, "3", *entry), "an owned entry passed for a shared claim"
    assert not verify(KEY, 3, "evil:1", *entry[1:]), "value changed"
    assert not verify(KEY, 3, "a:1", 101.0, *entry[2:]), "re-dated"
    assert not verify(KEY, 3, "a:1", 100.0, MALLORY.public_key, entry.signature), "owner swapped"
    assert not verify(KEY, 3, "a:1", 100.0, b"", b""), "unsigned"
    assert not verify(KEY, 3, "a:1", 100.0, b"\0" * 32, b"\0" * 64)


def test_the_verifier_memo_verifies_each_distinct_entry_once(monkeypatch):
    calls = []
    import dmoe.dht.signing as signing
    real = signing.verify
    monkeypatch.setattr(signing, "verify", lambda *args: calls.append(args) or real(*args))
    verifier = Verifier(capacity=4)
    entries = [ALICE.entry(KEY, i, "a:1", 100.0) for i in range(3)]
    for _ in range(5):
        assert all(verifier(KEY, i, *entry) for i, entry in enumerate(entries))
    assert len(calls) == 3
    assert not verifier(KEY, 0, *entries[1])


def test_a_uid_belongs_to_its_first_declarer_until_it_expires_and_replays_change_nothing():
    now = [100.0]
    storage = RecordStorage(clock=lambda: now[0])
    first = ALICE.entry(KEY, 7, "a:1", 150.0, issued_us=100_000_000)
    assert storage.store(KEY, 7, *first)
    with pytest.raises(NotOwner, match="owned by"):
        storage.store(KEY, 7, *MALLORY.entry(KEY, 7, "evil:1", 3000.0, issued_us=100_001_000))
    refresh = ALICE.entry(KEY, 7, "a:2", 160.0, issued_us=100_500_000)
    assert storage.store(KEY, 7, *refresh), "the owner could not refresh"
    assert not storage.store(KEY, 7, *first), "a replay rolled the entry back"
    assert not storage.store(KEY, 7, *refresh), "a repeated entry counted as a new store"
    assert storage.get(KEY)[7] == refresh
    now[0] = 161.0  # expired: the uid is free again
    assert storage.store(KEY, 7, *MALLORY.entry(KEY, 7, "m:1", 200.0, issued_us=161_000_000))


def test_shared_prefix_claims_merge_so_any_claim_extends_and_none_cuts_short():
    storage = RecordStorage(clock=lambda: 100.0)

    def claim(identity: Identity, subkey, value: str, expiration: float, issued_us: int) -> Entry:
        return identity.entry(KEY, subkey, value, expiration, issued_us=issued_us)

    assert storage.store(KEY, "3", *claim(ALICE, "3", "a:1", 150.0, 99_000_000))
    assert storage.store(KEY, "3", *claim(MALLORY, "3", "m:1", 101.0, 100_000_000)), "an honest declarer saw a failure"
    assert storage.get(KEY)["3"].expiration == 150.0, "a short claim cut the prefix short (issued later)"
    assert storage.store(KEY, "3", *claim(MALLORY, "3", "m:1", 170.0, 99_500_000))
    assert storage.store(KEY, "3", *claim(ALICE, "3", "a:1", 160.0, 100_000_000))
    assert storage.get(KEY)["3"].expiration == 170.0, "a later issue time cut a shared claim short"
    assert storage.store(KEY, 3, *claim(ALICE, 3, "a:1", 150.0, 100_000_000)), "owned and shared subkeys collided"


def test_far_future_expirations_are_refused_when_signed_and_capped_when_not():
    storage = RecordStorage(max_expiration=60.0, clock=lambda: 100.0)
    assert not storage.store(KEY, 1, *ALICE.entry(KEY, 1, "a:1", 1e12))
    assert storage.get(KEY) is None
    assert storage.store(KEY, 2, "a:1", 1e12)
    assert storage.get(KEY)[2].expiration == 160.0


def test_a_signed_expiration_up_to_the_clock_skew_beyond_max_expiration_is_kept():
    """A writer allows itself max_expiration on its own clock: a node whose clock was half a second behind dropped
    every such entry, silently (review 89). The same skew is allowed as for issue times."""
    storage = RecordStorage(max_expiration=60.0, clock=lambda: 100.0)
    assert storage.store(KEY, 1, *ALICE.entry(KEY, 1, "a:1", 160.0 + MAX_CLOCK_SKEW - 0.5, issued_us=100_500_000))
    assert storage.get(KEY)[1].expiration == 160.0 + MAX_CLOCK_SKEW - 0.5  # as signed: not re-dated
    assert not storage.store(KEY, 2, *ALICE.entry(KEY, 2, "a:1", 160.0 + MAX_CLOCK_SKEW + 0.5, issued_us=100_000_000))


def test_an_owners_older_entry_replayed_after_its_newest_expired_is_refused_and_the_subkey_is_free_to_others():
    """An owner's newest entry wins whatever its lifetime; once it had expired, a replay of an older, longer-lived
    one was taken again: a server stopped after a run with a shorter --expiration came back at its old endpoint for
    the rest of that entry's hour, and nobody could adopt the uid meanwhile (review 89)."""
    now = [100.0]
    storage = RecordStorage(max_expiration=600.0, clock=lambda: now[0])
    old = ALICE.entry(KEY, 1, "old:1", 690.0, issued_us=95_000_000)  # run 1: 10 minutes
    assert storage.store(KEY, 1, *old)
    assert storage.store(KEY, 1, *ALICE.entry(KEY, 1, "new:1", 103.0, issued_us=100_000_000))  # run 2: 3 s
    assert not storage.store(KEY, 1, *old)  # refused while the newest lives, as before
    now[0] = 104.0
    assert storage.get(KEY) is None
    assert not storage.store(KEY, 1, *old), "a replayed older entry came back once the newest had expired"
    assert storage.store(KEY, 1, *ALICE.entry(KEY, 1, "new:1", 200.0, issued_us=104_000_000))  # its owner, later
    now[0] = 201.0
    assert storage.store(KEY, 1, *MALLORY.entry(KEY, 1, "m:1", 300.0, issued_us=201_000_000))  # the cell is free
    now[0] = 301.0
    assert not storage.store(KEY, 1, *old), "another owner's entry in between freed the replay"


def test_expired_entries_are_remembered_within_the_entry_cap_and_only_while_an_older_one_may_live():
    now = [100.0]
    storage = RecordStorage(max_expiration=600.0, max_entries=4, clock=lambda: now[0])
    for subkey in range(12):
        issued = now[0]
        assert storage.store(KEY, subkey, *ALICE.entry(KEY, subkey, "a:1", issued + 5, issued_us=int(issued * 1e6)))
        now[0] += 6
        assert storage.get(KEY) is None
    assert len(storage._expired) <= 4 and (KEY, 11, ALICE.public_key) in storage._expired
    storage = RecordStorage(max_expiration=600.0, clock=lambda: now[0])
    issued = now[0]
    assert storage.store(KEY, 1, *ALICE.entry(KEY, 1, "a:1", issued + 600, issued_us=int(issued * 1e6)))
    now[0] = issued + 600 + MAX_CLOCK_SKEW  # no older entry of Alice can be live now: nothing to remember
    assert storage.get(KEY) is None and not storage._expired


def test_a_node_refuses_new_records_past_max_records_but_refreshes_old_ones():
    now = [100.0]
    storage = RecordStorage(max_records=3, clock=lambda: now[0])
    for i in range(3):
        assert storage.store(bytes([i]) * 20, 1, "a:1", 110.0 + i)
    with pytest.raises(RecordFull, match="max_records"):
        storage.store(b"x" * 20, 1, "a:1", 150.0)
    assert storage.store(bytes([0]) * 20, 1, "a:1", 150.0)
    now[0] = 111.5  # two records expired: room again
    assert storage.store(b"x" * 20, 1, "a:1", 150.0)


def test_a_node_refuses_new_entries_past_max_entries_across_records_and_expired_ones_make_room():
    now = [100.0]
    storage = RecordStorage(max_entries=5, clock=lambda: now[0])
    for i in range(5):  # 5 entries over 3 records
        assert storage.store(bytes([i % 3]) * 20, i, "a:1", 110.0 + i)
    assert storage.entries == 5
    with pytest.raises(RecordFull, match="max_entries"):
        storage.store(bytes([0]) * 20, 99, "a:1", 150.0)  # a new subkey of a held record
    with pytest.raises(RecordFull, match="max_entries"):
        storage.store(b"x" * 20, 1, "a:1", 150.0)  # a new record
    assert storage.store(bytes([1]) * 20, 1, "a:2", 150.0)  # refreshing a held entry adds none
    assert storage.entries == 5
    now[0] = 112.5  # the entries expiring at 110 and 112 are gone (111 was refreshed to 150)
    assert storage.store(b"x" * 20, 1, "a:1", 150.0)
    assert storage.entries == 4
    assert storage.store(bytes([0]) * 20, 99, "a:1", 150.0)
    assert storage.entries == 5 and len(storage) == 3  # the record at 2 lost its only entry
    with pytest.raises(RecordFull, match="max_entries"):
        storage.store(b"y" * 20, 1, "a:1", 150.0)


def test_clients_side_with_the_owner_most_replicas_hold_not_the_latest_expiration():
    honest = {5: ALICE.entry(KEY, 5, "a:1", 150.0), "2": ALICE.entry(KEY, "2", "a:1", 150.0)}
    lying = {5: MALLORY.entry(KEY, 5, "evil:1", 900.0), "2": MALLORY.entry(KEY, "2", "m:1", 900.0)}
    merged = merge_records([honest, honest, lying, honest], now=100.0)  # the same object: identical replicas
    assert merged[5].value == "a:1"
    assert merged["2"].expiration == 900.0, "shared claims: the longest-living one is kept"
    assert merge_records([honest, lying, lying], now=100.0)[5].value == "evil:1"  # a majority of liars wins
    assert merge_records([honest, lying], now=200.0)[5].value == "evil:1"  # the honest one expired


def test_votes_count_per_machine_so_one_socket_answering_under_many_node_ids_is_one_vote():
    """Node ids are free: a socket that answered a read under four ids near the key was four votes, and its owner
    won the uid over the two honest replicas."""
    honest = {5: ALICE.entry(KEY, 5, "a:1", 150.0)}
    lying = {5: MALLORY.entry(KEY, 5, "evil:1", 900.0)}
    voters = ["10.0.0.1", "10.0.0.2"] + ["10.6.6.6"] * 4
    assert merge_records([honest, honest] + [lying] * 4, now=100.0)[5].value == "evil:1"  # a vote per reply
    assert merge_records([honest, honest] + [lying] * 4, now=100.0, voters=voters)[5].value == "a:1"
    # different bytes under each id are still one machine's votes
    assert merge_records([honest, honest] + [dict(lying) for _ in range(4)], now=100.0, voters=voters)[5].value == \
        "a:1"
    # and one honest machine whose replicas sent the same bytes is one vote too: two lying machines win
    assert merge_records([honest] * 3 + [lying] * 2, now=100.0,
                         voters=["10.0.0.1"] * 3 + ["10.6.6.6", "10.7.7.7"])[5].value == "evil:1"


def test_replies_keep_only_entries_validly_signed_for_their_record():
    record = {1: ALICE.entry(KEY, 1, "a:1", 1e10), 2: ALICE.entry(OTHER_KEY, 2, "a:1", 1e10),
              3: Entry("evil:1", 1e10, ALICE.public_key, os.urandom(64)), 4: Entry("evil:1", 1e10),
              "5": MALLORY.entry(KEY, "5", "m:1", 1e10)}
    reply = umsgpack.unpackb(umsgpack.packb(find_value_reply(record, [])))
    parsed, _ = parse_find_value_reply(reply, KEY, Verifier())
    assert parsed == {1: record[1], "5": record["5"]}


def test_a_node_refuses_unsigned_forged_and_other_owner_stores_with_reasons():
    async def scenario() -> list:
        protocol = DHTProtocol(Node(b"n" * 20), RecordStorage(), DHTConfig())
        sender, node_id = ("127.0.0.1", 1), b"s" * 20
        entries = {1: ALICE.entry(KEY, 1, "a:1", time.time() + 60), 2: Entry("u:1", time.time() + 60),
                   3: Entry("f:1", time.time() + 60, ALICE.public_key, os.urandom(64))}
        results = protocol.rpc_store(sender, node_id, KEY, record_to_wire(entries))
        hijack = {1: MALLORY.entry(KEY, 1, "evil:1", time.time() + 600)}
        return results + protocol.rpc_store(sender, node_id, KEY, record_to_wire(hijack))

    results = asyncio.run(scenario())
    assert results[0] is True
    assert "signature" in results[1] and "signature" in results[2]
    assert "owned by" in results[3]


def test_an_entry_arriving_expired_or_too_far_ahead_is_dropped_and_logged_once_a_minute_per_host(caplog):
    """A writer whose clock is behind by more than an entry's lifetime (or ahead by more than max_expiration)
    has its stores dropped without an error it sees; the node names the likely cause, without flooding its log."""
    async def scenario() -> list:
        protocol = DHTProtocol(Node(b"n" * 20), RecordStorage(), DHTConfig(max_expiration=3600.0))
        node_id, now = b"s" * 20, time.time()
        # signed by writers whose clocks are off by that much: issued 60 s before their expirations
        behind = {1: ALICE.entry(KEY, 1, "a:1", now - 120, issued_us=int((now - 180) * 1_000_000)),
                  2: ALICE.entry(KEY, 2, "a:1", now - 300, issued_us=int((now - 360) * 1_000_000))}
        ahead = {3: ALICE.entry(KEY, 3, "a:1", now + 3600 + 900, issued_us=int((now + 3600 + 840) * 1_000_000))}
        fine = {4: ALICE.entry(KEY, 4, "a:1", now + 60), 5: ALICE.entry(KEY, 5, "a:1", now - 1, issued_us=0)}
        return [*protocol.rpc_store(("10.0.0.1", 1), node_id, KEY, record_to_wire(behind)),
                *protocol.rpc_store(("10.0.0.2", 1), node_id, KEY, record_to_wire(ahead)),
                *protocol.rpc_store(("10.0.0.3", 1), node_id, KEY, record_to_wire(fine))]

    with caplog.at_level("WARNING", logger="dmoe.dht.protocol"):
        results = asyncio.run(scenario())
    assert results == [False, False, False, True, False]
    warnings = [r.getMessage() for r in caplog.records if "clock" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per skewed host; a second of the same host's, and 1 s late, are not
    assert "10.0.0.1" in warnings[0] and "already expired by 120 s" in warnings[0]
    assert "10.0.0.2" in warnings[1] and "beyond max_expiration by 900 s" in warnings[1]


def test_a_purge_that_frees_an_entry_lets_a_new_subkey_in_even_while_the_records_are_at_their_cap():
    now = [1000.0]
    storage = RecordStorage(max_records=2, max_entries=3, clock=lambda: now[0])
    a, b = b"A" * 20, b"B" * 20
    assert storage.store(a, "x", "v", 1050.0) and storage.store(a, "y", "v", 1500.0)
    assert storage.store(b, "x", "v", 1500.0)
    now[0] = 1100.0  # a.x expired: room for one entry, none for a record
    assert storage.store(b, "new", "v", 1500.0) and storage.entries == 3
    with pytest.raises(RecordFull, match="max_records"):
        storage.store(b"C" * 20, "x", "v", 1500.0)


def test_a_node_holds_a_flooding_machine_to_its_share_and_logs_one_warning_for_the_flood(caplog):
    """Throwaway keys sign entries cheaply: without a share per machine, one flooder filled a node's max_entries
    and locked every honest writer out; each refused entry was also a warning in the node's log."""
    async def scenario() -> tuple[list, list]:
        config = DHTConfig(max_entries=64, max_records=1024, sender_share=1 / 16)  # share: 4 entries
        storage = RecordStorage(max_entries=64, max_records=1024, sender_share=1 / 16)
        protocol = DHTProtocol(Node(b"n" * 20), storage, config)
        node_id, expiration, flooder = b"s" * 20, time.time() + 600, Identity()
        flood = [protocol.rpc_store(("203.0.113.9", 1), node_id, bytes([i]) * 20,
                                    record_to_wire({1: flooder.entry(bytes([i]) * 20, 1, "evil:1", expiration)}))[0]
                 for i in range(100)]
        honest = [protocol.rpc_store(("198.51.100.7", 1), node_id, KEY,
                                     record_to_wire({i: ALICE.entry(KEY, i, "a:1", expiration)}))[0] for i in range(4)]
        return flood, honest

    with caplog.at_level("WARNING", logger="dmoe.dht.protocol"):
        flood, honest = asyncio.run(scenario())
    assert flood[:32] == [True] * 32 and all("record full: 203.0.113.9 already holds 32" in r for r in flood[32:])
    assert honest == [True] * 4
    warnings = [r.getMessage() for r in caplog.records if "refusing store" in r.getMessage()]
    assert len(warnings) == 1 and "203.0.113.9" in warnings[0], warnings


def test_throttled_warnings_log_once_per_host_and_kind_a_period_and_few_in_all(caplog):
    now = [0.0]
    warnings = ThrottledWarnings(logging.getLogger("test.throttle"), period=60.0, max_per_period=3,
                                 clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="test.throttle"):
        assert warnings.warn("bad", "10.0.0.1", "bad datagram from %s", "10.0.0.1")
        assert not warnings.warn("bad", "10.0.0.1", "bad datagram from %s", "10.0.0.1")
        assert warnings.warn("forged", "10.0.0.1", "forged entry from %s", "10.0.0.1")
        assert warnings.warn("bad", "10.0.0.2", "bad datagram from %s", "10.0.0.2")
        assert not warnings.warn("bad", "10.0.0.3", "bad datagram from %s", "10.0.0.3"), "past max_per_period"
        now[0] = 61.0
        assert warnings.warn("bad", "10.0.0.1", "bad datagram from %s", "10.0.0.1%eth0")
    logged = [r.getMessage() for r in caplog.records]
    left_out = " ({} more warnings about peers left out since the last one)"
    assert logged == ["bad datagram from 10.0.0.1", "forged entry from 10.0.0.1" + left_out.format(1),
                      "bad datagram from 10.0.0.2", "bad datagram from 10.0.0.1%eth0" + left_out.format(1)]


def test_a_flood_of_garbage_datagrams_is_one_warning():
    async def scenario() -> bool:
        protocol = DHTProtocol(Node(b"n" * 20), RecordStorage(), DHTConfig())
        logged = []
        protocol.warnings.logger = type("Log", (), {"warning": lambda self, *args: logged.append(args)})()
        for _ in range(1000):
            protocol.datagram_received(b"\xff garbage", ("192.0.2.5", 9))
            protocol.datagram_received(b"\x00", ("192.0.2.5", 9))
        return logged

    logged = asyncio.run(scenario())
    assert len(logged) == 1 and "malformed datagram" in logged[0][0]


def test_a_tie_between_owners_reads_as_absent_and_is_reported():
    """The later expiration won a tie, and a hijacker signs the longest one allowed: one hostile machine and one
    replica it had poisoned beat two honest ones."""
    honest = {5: ALICE.entry(KEY, 5, "a:1", 150.0)}
    lying = {5: MALLORY.entry(KEY, 5, "evil:1", 900.0)}
    disputes: dict = {}
    ties: dict = {}  # (with whom: a server whose declaration ties learns it, review 105 D4)
    merged = merge_records([honest, dict(honest), lying, dict(lying)], now=100.0,
                           voters=["10.0.0.1", "10.0.0.2", "10.6.6.6", "10.7.7.7"], disputes=disputes, ties=ties)
    assert 5 not in merged and disputes[5].startswith("2 votes to 2")
    assert sorted(entry.value for entry in ties[5]) == ["a:1", "evil:1"]
    disputes.clear()
    ties.clear()
    merged = merge_records([honest, dict(honest), lying], now=100.0, voters=["10.0.0.1", "10.0.0.2", "10.6.6.6"],
                           disputes=disputes, ties=ties)
    assert merged[5].value == "a:1" and disputes[5].startswith("2 votes to 1") and not ties


def test_an_owner_s_last_issued_entry_wins_whatever_its_expiration_and_its_older_ones_replay_nowhere():
    """Review 70, finding 2: one owner's entries were ordered by expiration, so a server restarted with its key and
    a shorter expiration (at a new endpoint) was refused as "superseded" by its own earlier, longer-lived entry,
    and readers went to the dead endpoint for up to max_expiration. The signed issue time orders them now, and a
    replay of the older entry (issued earlier, expiring later) changes nothing at nodes or readers."""
    now = 1000.0
    storage = RecordStorage(clock=lambda: now)
    old = ALICE.entry(KEY, 7, "a:5001", now + 900, issued_us=int(now * 1_000_000) - 60_000_000)  # run 1, a minute ago
    new = ALICE.entry(KEY, 7, "a:5002", now + 30, issued_us=int(now * 1_000_000))  # run 2, now
    assert storage.store(KEY, 7, *old)
    assert storage.store(KEY, 7, *new), "the restarted owner was refused its own uid"
    assert storage.get(KEY)[7] == new
    assert not storage.store(KEY, 7, *old), "a replay of the older entry rolled the uid back"
    assert storage.get(KEY)[7] == new
    # readers: replicas that still serve the older entry (stale, or replaying it) cannot outvote the owner's own
    assert merge_records([{7: old}, {7: new}, {7: old}], now=now)[7] == new
    assert merge_records([{7: old}, {7: new}, {7: old}], now=now, voters=["10.0.0.1", "10.0.0.2", "10.0.0.3"])[7] \
        == new
    # a shared claim stays the longest-living, whoever issued it last
    claims = [ALICE.entry(KEY, "7", "a:1", now + 900, issued_us=999_000_000), ALICE.entry(KEY, "7", "a:2", now + 30,
                                                                                     issued_us=1_000_000_000)]
    assert merge_records([{"7": claims[0]}, {"7": claims[1]}], now=now)["7"] == claims[0]


def test_a_node_refuses_replays_by_issue_time_before_verifying_and_issue_times_in_the_future_or_after_expiry():
    async def scenario() -> None:
        protocol = DHTProtocol(Node(b"n" * 20), RecordStorage(), DHTConfig())
        node_id, sender, now = b"s" * 20, ("10.0.0.1", 1), time.time()
        issued = int(now * 1_000_000)
        old = ALICE.entry(KEY, 7, "a:5001", now + 900, issued_us=issued - 60_000_000)
        new = ALICE.entry(KEY, 7, "a:5002", now + 30, issued_us=issued)
        assert protocol.rpc_store(sender, node_id, KEY, record_to_wire({7: old})) == [True]
        assert protocol.rpc_store(sender, node_id, KEY, record_to_wire({7: new})) == [True]
        checked = []
        protocol.verifier = lambda *entry: checked.append(entry) or True
        assert protocol.rpc_store(sender, node_id, KEY, record_to_wire({7: old})) == [False]
        assert protocol.rpc_store(sender, node_id, KEY, record_to_wire({7: new})) == [False]  # a repeat
        assert not checked, "a replay cost a verification"
        assert protocol.storage.get(KEY)[7] == new
        protocol.verifier = Verifier()
        # issued further ahead of this node's clock than MAX_CLOCK_SKEW: the writer's clock is off
        ahead = ALICE.entry(KEY, 8, "a:1", now + 60, issued_us=issued + int((MAX_CLOCK_SKEW + 5) * 1_000_000))
        slightly = ALICE.entry(KEY, 9, "a:1", now + 60, issued_us=issued + int((MAX_CLOCK_SKEW - 5) * 1_000_000))
        assert protocol.rpc_store(sender, node_id, KEY, record_to_wire({8: ahead, 9: slightly})) == [False, True]
        # issued after the entry's expiration: malformed, as is an entry of the format without issue times (v1)
        late = ALICE.entry(KEY, 10, "a:1", now + 60, issued_us=int((now + 61) * 1_000_000))
        with pytest.raises(MalformedRequest, match="issue time"):
            protocol.rpc_store(sender, node_id, KEY, record_to_wire({10: late}))
        with pytest.raises(MalformedRequest, match="issued_us"):
            protocol.rpc_store(sender, node_id, KEY, [wire[:5] for wire in record_to_wire({11: new})])
        for bad in ["1", 1.5, True, -1, 2**63]:
            with pytest.raises(MalformedRequest, match="issue time"):
                protocol.rpc_store(sender, node_id, KEY, [[*record_to_wire({11: new})[0][:5], bad]])

    asyncio.run(scenario())


def _v1_entry(identity: Identity, key: bytes, subkey, value: str, expiration: float) -> Entry:
    """An entry signed as before issue times were signed (domain v1, no issue time)."""
    kind = b"i" if isinstance(subkey, int) else b"s"
    subkey_bytes = str(subkey).encode()
    message = b"".join((b"dmoe-dht-entry-v1\x00", key, struct.pack(">d", float(expiration)), kind,
                        len(subkey_bytes).to_bytes(1, "big"), subkey_bytes, value.encode()))
    return Entry(value, float(expiration), identity.public_key, identity._private_key.sign(message))


def test_a_signature_covers_the_issue_time_and_entries_signed_before_it_was_signed_verify_nowhere(caplog):
    entry = ALICE.entry(KEY, 3, "a:1", 100.0, issued_us=50_000_000)
    assert verify(KEY, 3, *entry)
    assert not verify(KEY, 3, *entry._replace(issued_us=60_000_000)), "re-issued"
    assert not verify(KEY, 3, *entry._replace(issued_us=-1)) and not verify(KEY, 3, *entry._replace(issued_us=1.5))
    v1 = _v1_entry(ALICE, KEY, 3, "a:1", 100.0)
    assert not verify(KEY, 3, *v1), "a v1 signature passed for a v2 entry issued at 0"
    # readers: a v1 reply (entries without an issue time) is malformed; v1 signatures are dropped as forged
    text = json.dumps([[3, "a:1", 100.0]])
    with pytest.raises(MalformedRequest, match="issued_us"):
        parse_find_value_reply({"record": text, "auth": v1.owner + v1.signature, "nodes": "[]"}, KEY, Verifier())
    with caplog.at_level("WARNING", logger="dmoe.dht.messages"):
        record, _ = parse_find_value_reply(find_value_reply({3: v1}, []), KEY, Verifier())
    assert record == {} and "ignoring 1 unsigned or forged entries" in caplog.text
    # nodes: refused as unsigned or forged, counted as the other such entries are
    async def store() -> list:
        protocol = DHTProtocol(Node(b"n" * 20), RecordStorage(), DHTConfig())
        fresh = _v1_entry(ALICE, KEY, 3, "a:1", time.time() + 60)
        return protocol.rpc_store(("10.0.0.1", 1), b"s" * 20, KEY, record_to_wire({3: fresh}))

    assert asyncio.run(store()) == ["refused: unsigned or bad signature"]


def test_an_identity_issues_its_entries_in_strictly_increasing_microseconds_of_its_clock():
    identity = Identity()
    before = int(time.time() * 1_000_000)
    issued = [identity.entry(KEY, 1, "a:1", 1e10).issued_us for _ in range(200)]
    assert issued == sorted(set(issued)) and before <= issued[0] <= int(time.time() * 1_000_000) + 200


def test_signatures_that_are_no_dht_entrys_cover_the_version_1_message_so_replicas_on_disk_still_verify():
    """Replica snapshots and averaging parts are signed through Identity.sign without an issue time: they must verify
    as they did before issue times existed (a replica held on disk since then is adopted), while a DHT entry, which
    always carries one, verifies only under version 2."""
    identity = Identity()
    key, value, expiration = b"k" * 20, "snapshot-digest", 0.0
    before = identity._private_key.sign(b"".join((b"dmoe-dht-entry-v1\x00", key, struct.pack(">d", expiration), b"i",
                                                  (1).to_bytes(1, "big"), b"3", value.encode())))
    assert verify(key, 3, value, expiration, identity.public_key, before)
    assert identity.sign(key, 3, value, expiration) == before  # (Ed25519 signs deterministically)
    assert not verify(key, 3, value, expiration, identity.public_key, before, 0)  # not as a DHT entry
