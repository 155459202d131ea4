"""Record storage: entries merged per subkey, the latest expiration wins, expiry, limits and versions."""
from __future__ import annotations

import pytest

from dmoe.dht.storage import Entry, RecordFull, RecordStorage, merge_records, sender_group

KEY = b"k" * 20


def test_records_from_different_declarers_merge_per_subkey_and_the_latest_expiration_wins():
    storage = RecordStorage(clock=lambda: 100.0)
    assert storage.store(KEY, 3, "a:1", 150.0)
    assert storage.store(KEY, 4, "b:2", 120.0)
    assert not storage.store(KEY, 3, "c:3", 140.0), "an older declaration overwrote a newer one"
    assert storage.store(KEY, 3, "c:3", 160.0)
    assert storage.get(KEY) == {3: Entry("c:3", 160.0), 4: Entry("b:2", 120.0)}


def test_expired_entries_disappear_and_far_future_expirations_are_capped():
    now = [100.0]
    storage = RecordStorage(max_expiration=60.0, clock=lambda: now[0])
    storage.store(KEY, 1, "a:1", 110.0)
    storage.store(KEY, 2, "b:2", 1e12)
    assert storage.get(KEY)[2][1] == 160.0
    assert not storage.store(KEY, 3, "c:3", 99.0), "an already expired entry was stored"
    now[0] = 120.0
    assert storage.get(KEY) == {2: Entry("b:2", 160.0)}
    now[0] = 161.0
    assert storage.get(KEY) is None and list(storage) == []
    assert storage.iter_older_than(0) == [], "holders must never republish (owners refresh)"


def test_an_entry_expires_on_time_whatever_was_stored_and_read_before_it():
    now = [100.0]
    storage = RecordStorage(clock=lambda: now[0])
    storage.store(KEY, 1, "a:1", 500.0)
    assert storage.get(KEY) == {1: Entry("a:1", 500.0)}  # read: nothing there expires before 500
    storage.store(KEY, 2, "b:2", 200.0)                   # ...until this is stored
    storage.store(KEY, 1, "a:1", 900.0)                   # and a refresh moves the earliest expiration later
    now[0] = 199.0
    assert set(storage.get(KEY)) == {1, 2}
    now[0] = 200.0
    assert storage.get(KEY) == {1: Entry("a:1", 900.0)}
    now[0] = 899.0
    assert storage.live(KEY) == {1: Entry("a:1", 900.0)}
    now[0] = 900.0
    assert storage.live(KEY) is None and storage.get(KEY) is None and KEY not in storage.versions


def test_merge_records_drops_expired_and_keeps_latest():
    merged = merge_records([{1: Entry("a", 10.0), 2: Entry("b", 5.0)}, {1: Entry("c", 20.0), 3: Entry("d", 1.0)}],
                           now=4.0)
    assert merged == {1: Entry("c", 20.0), 2: Entry("b", 5.0)}


def test_a_full_record_refuses_new_subkeys_with_a_clear_error_but_accepts_refreshes():
    storage = RecordStorage(max_subkeys=256, clock=lambda: 0.0)
    for coord in range(256):
        assert storage.store(KEY, coord, "127.0.0.1:65535", 10.0)
    with pytest.raises(RecordFull, match="max_record_subkeys"):
        storage.store(KEY, 256, "127.0.0.1:65535", 10.0)
    assert storage.store(KEY, 7, "127.0.0.1:65535", 20.0)


def test_a_records_version_changes_exactly_when_its_live_entries_do():
    now = [100.0]
    storage = RecordStorage(clock=lambda: now[0])
    storage.store(KEY, 1, "a:1", 150.0)
    first = storage.versions[KEY]
    assert not storage.store(KEY, 1, "a:1", 150.0)                # a replay: nothing changes
    assert storage.versions[KEY] == first
    storage.store(KEY, 1, "a:1", 160.0)                            # refreshed
    refreshed = storage.versions[KEY]
    storage.store(KEY, 2, "b:2", 120.0)
    assert len({first, refreshed, storage.versions[KEY]}) == 3
    before_expiry = storage.versions[KEY]
    now[0] = 130.0
    storage.get(KEY)                                               # subkey 2 expired
    assert storage.versions[KEY] != before_expiry


def test_sender_groups_are_ipv4_hosts_and_ipv6_64s_and_this_host_is_nobody():
    assert sender_group("10.1.2.3") == "10.1.2.3" and sender_group("::ffff:10.1.2.3") == "10.1.2.3"
    assert sender_group("2001:db8:1:2::7") == sender_group("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert sender_group("2001:db8:1:3::7") != sender_group("2001:db8:1:2::7")
    assert sender_group("fe80::1%eth0") == "fe80::/64"
    for here in ("127.0.0.1", "127.5.5.5", "::1", "::ffff:127.0.0.1", "not an address", ""):
        assert sender_group(here) == ""


def test_one_flooding_sender_fills_at_most_half_a_node_and_its_share_and_honest_senders_still_store():
    now = [100.0]
    storage = RecordStorage(max_records=64, max_entries=32, sender_share=1 / 8, clock=lambda: now[0])  # share: 4
    flooded = 0
    with pytest.raises(RecordFull, match="10.0.0.66 already holds 16 of the 16 entries of this node, its share"):
        for i in range(32):
            storage.store(KEY, i, "evil:1", 110.0, sender="10.0.0.66")
            flooded += 1
    assert flooded == 16 and storage.entries_of["10.0.0.66"] == 16
    assert storage.store(KEY, 3, "evil:1", 150.0, sender="10.0.0.66"), "refreshing what it holds was refused"
    for i in range(100, 104):  # an honest machine still gets its share...
        assert storage.store(KEY, i, "ok:1", 200.0, sender="10.0.0.7")
    with pytest.raises(RecordFull, match="10.0.0.7 already holds 4"):  # ...and no more while the node is this full
        storage.store(KEY, 104, "ok:1", 200.0, sender="10.0.0.7")
    for i in range(200, 212):  # this host's own processes are nobody's share: only the caps bind them
        assert storage.store(KEY, i, "here:1", 200.0)
    with pytest.raises(RecordFull, match="max_entries"):
        storage.store(KEY, 212, "here:1", 200.0)
    assert storage.entries_of == {"10.0.0.66": 16, "10.0.0.7": 4, "": 12}
    now[0] = 120.0  # the flood expires (but the refreshed entry): its room is everybody's again
    for i in range(300, 312):
        assert storage.store(KEY, i, "new:1", 200.0, sender=f"10.0.1.{i % 3}")
    assert storage.entries_of == {"10.0.0.66": 1, "10.0.0.7": 4, "": 12, "10.0.1.0": 4, "10.0.1.1": 4,
                                  "10.0.1.2": 4}
    assert storage.entries == 29 and sum(storage.entries_of.values()) == storage.entries


def test_a_flood_of_new_records_from_one_sender_is_held_to_its_share_of_records():
    storage = RecordStorage(max_records=16, max_entries=1024, sender_share=1 / 8, clock=lambda: 100.0)  # share: 2
    for i in range(8):
        assert storage.store(bytes([i]) * 20, 1, "evil:1", 200.0, sender=sender_group("2001:db8::1"))
    with pytest.raises(RecordFull, match="2001:db8::/64 already holds 8 of the 8 records"):
        storage.store(b"x" * 20, 1, "evil:1", 200.0, sender=sender_group("2001:db8::2"))
    assert storage.store(bytes([0]) * 20, 2, "evil:1", 200.0, sender=sender_group("2001:db8::2")), "a held record took no entry"
    assert storage.store(b"y" * 20, 1, "ok:1", 200.0, sender="10.0.0.7")
    assert storage.records_of == {"2001:db8::/64": 8, "10.0.0.7": 1}


def test_an_entry_refreshed_by_another_machine_counts_against_that_machine_and_expiry_balances_the_books():
    now = [100.0]
    storage = RecordStorage(clock=lambda: now[0])
    storage.store(KEY, 1, "a:1", 150.0, sender="10.0.0.1")
    storage.store(KEY, 2, "a:1", 120.0, sender="10.0.0.1")
    storage.store(KEY, 1, "a:1", 160.0, sender="10.0.0.2")  # a reader repairing the record with a newer copy
    assert storage.entries_of == {"10.0.0.1": 1, "10.0.0.2": 1} and storage.records_of == {"10.0.0.1": 1}
    assert not storage.store(KEY, 1, "a:1", 155.0, sender="10.0.0.3"), "an older copy replaced the newer one"
    assert storage.entries_of == {"10.0.0.1": 1, "10.0.0.2": 1}
    now[0] = 170.0
    assert storage.get(KEY) is None
    assert storage.entries_of == {} and storage.records_of == {} and storage.entries == 0
