"""Records whose values are dictionaries merged per subkey, each subkey with its own absolute expiration.

Stock ``ForgetfulStorage`` keeps one opaque value per key, so two servers announcing under one prefix overwrite
each other, and its week-long TTL keeps stale copies alive. Here a record is ``{subkey: (value, expiration)}``:
concurrent declarations merge, the latest expiration of a subkey wins, and expired entries vanish on access.
Expirations are absolute wall-clock times (``time.time()``) carried in every message, so a copy replicated or
repaired anywhere can never live longer than its owner intended.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, Union

from kademlia.storage import IStorage

Subkey = Union[int, str]
Entry = tuple[str, float]  # (value, absolute expiration)
Record = dict[Subkey, Entry]


class RecordFull(ValueError):
    """A store would grow a record past ``max_record_subkeys``: its replies would no longer fit in a datagram."""


def merge_entry(record: Record, subkey: Subkey, value: str, expiration: float) -> bool:
    """Keeps the entry with the latest expiration; True when the given one is (now) the stored one."""
    current = record.get(subkey)
    if current is not None and current[1] > expiration:
        return False
    record[subkey] = (value, expiration)
    return True


def merge_records(records: list[Record], now: float | None = None) -> Record:
    """Per subkey, the entry with the latest expiration among ``records``, dropping expired ones."""
    now = time.time() if now is None else now
    merged: Record = {}
    for record in records:
        for subkey, (value, expiration) in record.items():
            if expiration > now:
                merge_entry(merged, subkey, value, expiration)
    return merged


class RecordStorage(IStorage):
    """A node's local records, keyed by the 20-byte key digest."""

    def __init__(self, max_subkeys: int = 256, max_expiration: float = 3600.0,
                 clock: Callable[[], float] = time.time):
        self.max_subkeys = max_subkeys
        self.max_expiration = max_expiration
        self.clock = clock
        self.data: dict[bytes, Record] = {}

    def store(self, key: bytes, subkey: Subkey, value: str, expiration: float) -> bool:
        """Merges one entry; False if already expired or older than what is held; raises :class:`RecordFull`."""
        now = self.clock()
        expiration = min(float(expiration), now + self.max_expiration)
        if expiration <= now:
            return False
        record = self._live(key)
        if record is None:
            record = self.data[key] = {}
        if subkey not in record and len(record) >= self.max_subkeys:
            raise RecordFull(f"record {key.hex()} already holds {len(record)} subkeys (max_record_subkeys)")
        return merge_entry(record, subkey, value, expiration)

    def _live(self, key: bytes) -> Record | None:
        record = self.data.get(key)
        if record is None:
            return None
        now = self.clock()
        for subkey in [s for s, (_, expiration) in record.items() if expiration <= now]:
            del record[subkey]
        if not record:
            del self.data[key]
            return None
        return record

    def get(self, key: bytes, default: Record | None = None) -> Record | None:
        """A copy of the live entries of ``key``, or ``default`` when none are left."""
        record = self._live(key)
        return dict(record) if record is not None else default

    def __getitem__(self, key: bytes) -> Record:
        record = self.get(key)
        if record is None:
            raise KeyError(key)
        return record

    def __setitem__(self, key: bytes, record: Record) -> None:
        """Merges a whole record (the ``IStorage`` seam); entries past the subkey limit are skipped."""
        for subkey, (value, expiration) in record.items():
            try:
                self.store(key, subkey, value, expiration)
            except RecordFull:
                break

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, Record]]:
        """Nothing is ever republished by storage holders: owners refresh their own declarations."""
        return []

    def __iter__(self) -> Iterator[tuple[bytes, Record]]:
        for key in list(self.data):
            record = self.get(key)
            if record is not None:
                yield key, record

    def __len__(self) -> int:
        return sum(1 for _ in self)
