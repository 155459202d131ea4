"""Record storage: entries merged per subkey, the latest expiration wins, expiry, limits and versions."""
from __future__ import annotations

import pytest

from dmoe.dht.storage import Entry, RecordFull, RecordStorage, merge_records

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
