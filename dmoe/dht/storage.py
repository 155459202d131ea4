"""Records whose values are dictionaries merged per subkey, each subkey with its own absolute expiration.

Stock ``ForgetfulStorage`` keeps one opaque value per key, so two writers of one key overwrite each other, and its
week-long TTL keeps stale copies alive. Here a record is ``{subkey: (value, expiration)}``: concurrent writes merge,
the newest entry of a subkey wins (see below), and expired entries vanish on access. Expirations are absolute
wall-clock times (``time.time()``) carried in every message, so a copy replicated or repaired anywhere can never live
longer than its owner intended.

Entries are signed (:mod:`dmoe.dht.signing`) and come in two kinds, told apart by the subkey's type:

* an **int** subkey is *owned* by the key that stored it first: until it expires only that key may replace it, the
  entry it issued last wins (its signed issue time, whatever the expirations: a server restarted with a shorter
  expiration takes its uids back at once), and replays of its older entries are refused (:mod:`dmoe.directory`
  keeps a uid's endpoint so);
* a **str** subkey is *shared*: any validly signed entry may extend it, none can shorten it, so the entry kept is the
  one living longest (the directory's claims that something under a prefix is alive).
"""
from __future__ import annotations

import ipaddress
import math
import time
from collections import defaultdict
from typing import Callable, Hashable, Iterator, NamedTuple, Sequence, Union

from kademlia.storage import IStorage

from dmoe.endpoints import machine_of

Subkey = Union[int, str]


class Entry(NamedTuple):
    value: str
    expiration: float  # absolute, time.time()
    owner: bytes = b""  # Ed25519 public key of the writer (empty: unsigned, refused by nodes and clients)
    signature: bytes = b""
    issued_us: int = 0  # the writer's wall clock when it signed, in microseconds (signed): orders its entries


#: seconds an entry's issue time may be ahead of a node's clock: beyond it the node refuses the entry, as a writer
#: whose clock is off (an entry issued in the future would keep its owner's next ones out until that time)
MAX_CLOCK_SKEW = 10.0


Record = dict[Subkey, Entry]


class RecordFull(ValueError):
    """A store would grow a record past ``max_record_subkeys`` (its replies would no longer fit in a datagram),
    the node past ``max_records`` or ``max_entries``, or its sender past its share of a node over half full."""


def sender_group(host: str) -> str:
    """Whose share of a node's storage a store from ``host`` counts against: the IPv4 address, or an IPv6 address's
    /64 (one machine is commonly given a whole /64, so its addresses are one sender). Loopback and unparsable hosts
    give ``""``: this machine's own processes, which no share limits."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return ""
    mapped = getattr(address, "ipv4_mapped", None)
    return "" if (mapped or address).is_loopback else machine_of(address)


def check_expiration(expiration: float, max_expiration: float, now: float | None = None) -> None:
    """Raises ValueError for an expiration further than ``max_expiration`` seconds ahead: every node refuses such a
    signed entry (re-dating it would break its signature), so without this the write was lost silently."""
    ahead = expiration - (time.time() if now is None else now)
    if ahead > max_expiration:
        raise ValueError(f"an expiration {ahead:.0f} s ahead is beyond max_expiration ({max_expiration:.0f} s): every "
                         f"node would refuse the entry")


def to_milliseconds(expiration: float) -> float:
    """An expiration as entries are signed and sent: to the millisecond (shorter in every reply), rounded down, so
    that one checked against ``max_expiration`` (:func:`check_expiration`) stays within it."""
    return math.floor(float(expiration) * 1000) / 1000


def issue_time_fits(issued_us: int, expiration: float, now: float) -> bool:
    """An issue time a node takes: not after the entry's expiration, nor more than :data:`MAX_CLOCK_SKEW` ahead of
    ``now`` (the node's clock)."""
    return issued_us <= expiration * 1_000_000 and issued_us <= (now + MAX_CLOCK_SKEW) * 1_000_000


class NotOwner(ValueError):
    """A store to an owned subkey whose live entry belongs to another key."""


def supersedes(subkey: Subkey, entry: Entry, current: Entry) -> bool:
    """Whether ``entry`` replaces ``current`` at ``subkey``: at an owned (int) subkey (both of one owner), the one
    issued later (then, for the same issue time, the later expiration), so an older entry replayed never replaces a
    newer one whatever its expiration, and an owner's new entry replaces its old one whatever their lifetimes; at a
    shared (str) subkey, the one living longer."""
    if isinstance(subkey, int):
        return (entry.issued_us, entry.expiration) > (current.issued_us, current.expiration)
    return entry.expiration > current.expiration


def merge_entry(record: Record, subkey: Subkey, entry: Entry) -> bool:
    """Keeps the newest entry (:func:`supersedes`; for an owned subkey, only its owner's); True when ``entry`` was
    stored or, for a shared claim, when the stored claim lives at least as long (so no writer sees a failure
    because another one's claim outlives its own). A replayed or repeated entry changes nothing: False."""
    current = record.get(subkey)
    if current is not None:
        if isinstance(subkey, int) and current.owner != entry.owner:
            raise NotOwner(f"subkey {subkey} is owned by {current.owner.hex()[:16]} until {current.expiration:.0f}")
        if not supersedes(subkey, entry, current):
            return isinstance(subkey, str)
    record[subkey] = entry
    return True


def merge_records(records: list[Record], now: float | None = None, voters: Sequence[Hashable] | None = None,
                  disputes: dict[Subkey, str] | None = None, ties: dict[Subkey, list[Entry]] | None = None) -> Record:
    """Per subkey, the newest live entry among ``records`` (:func:`supersedes`: an owner's latest issued, a shared
    claim's longest living; one record per responding replica, the same record object may appear several times,
    once per replica that sent identical bytes).

    For an owned (int) subkey that replicas give to different owners (a lying replica), the owner held by the most
    voters wins; a tie between owners gives no entry (it went to the one expiring last, which a hijacker always
    signs far ahead). ``disputes``: filled with each such subkey and who held it (to log). ``ties``: filled with each
    subkey read as absent for a tie, and the latest entry of every owner that tied for the most votes (a server
    whose own declaration ties with another's learns with whom, signed, see
    :meth:`dmoe.replicas.adoption.Adopter.drop_taken`). ``voters``: per record, who sent it, where votes are counted per
    machine (:func:`~dmoe.dht.routing.contact_machine` of the replica's address): one machine answering under
    several node ids is one vote however many of its replies are merged. Without it, each record is a vote.

    What this protects: a lying machine among the replicas read cannot hide the true owner's entry by serving its
    own with a later expiration, nor outvote honest machines with ids of its own. What it does not: machines that
    are the majority of the replicas read win the vote, and one that crowds honest replicas out of a read (ids
    closer to the key than theirs, when the search takes many contacts of one machine) is the only voter.
    """
    now = time.time() if now is None else now
    backers: dict[int, set[Hashable]] = {}  # id(record) -> who sent those very bytes
    unique: list[Record] = []
    for index, record in enumerate(records):
        if id(record) not in backers:
            backers[id(record)] = set()
            unique.append(record)
        backers[id(record)].add(index if voters is None else voters[index])
    if len(unique) == 1:  # the usual case: every replica sent the same bytes, parsed once
        return {subkey: entry for subkey, entry in unique[0].items() if entry.expiration > now}
    merged: Record = {}
    contested: set[Subkey] = set()
    for record in unique:
        for subkey, entry in record.items():
            if entry.expiration <= now:
                continue
            current = merged.get(subkey)
            if current is None:
                merged[subkey] = entry
                continue
            if isinstance(subkey, int) and current.owner != entry.owner:
                contested.add(subkey)  # decided by the vote below
            elif supersedes(subkey, entry, current):
                merged[subkey] = entry
    for subkey in contested:
        votes: dict[bytes, set[Hashable]] = defaultdict(set)  # per owner, the voters whose replies hold it
        latest: dict[bytes, Entry] = {}
        for record in unique:
            entry = record.get(subkey)
            if entry is not None and entry.expiration > now:
                votes[entry.owner] |= backers[id(record)]
                if entry.owner not in latest or supersedes(subkey, entry, latest[entry.owner]):
                    latest[entry.owner] = entry
        ranked = sorted(votes, key=lambda owner: len(votes[owner]), reverse=True)
        tied = len(votes[ranked[0]]) == len(votes[ranked[1]])
        if disputes is not None:
            disputes[subkey] = (f"{len(votes[ranked[0]])} votes to {len(votes[ranked[1]])}: "
                                 + ", ".join(f"{owner.hex()[:16]} at {latest[owner].value}" for owner in ranked[:2]))
        if tied:
            # no entry: a tie went to the later expiration, which a hijacker always signs (an hour ahead), so one
            # hostile machine and one replica it had poisoned (by a hand-over) beat the owner's two
            merged.pop(subkey, None)
            if ties is not None:
                ties[subkey] = [latest[owner] for owner in ranked if len(votes[owner]) == len(votes[ranked[0]])]
        else:
            merged[subkey] = latest[ranked[0]]
    return merged


def missing_entries(held: Record, record: Record, *, older_too: bool = False) -> Record:
    """The entries of ``record`` that ``held`` (what a replica sent) lacks, and with ``older_too`` also those it
    holds older (:func:`supersedes`): what to store on that replica so it serves ``record``."""
    if not older_too and held.keys() >= record.keys():
        return {}  # the usual case, checked without a loop in Python
    return {subkey: entry for subkey, entry in record.items()
            if (have := held.get(subkey)) is None or (older_too and supersedes(subkey, entry, have))}


class RecordStorage(IStorage):
    """A node's local records, keyed by the 20-byte key digest.

    Senders' shares: ``max_records`` and ``max_entries`` alone let one flooding machine fill a node (signing
    entries under throwaway keys is cheap) and lock every honest writer out until its entries expire, which it
    can postpone by refreshing them. So once a node holds half of either cap, a sender (:func:`sender_group`)
    that already holds ``sender_share`` of it gets no new record or entry there; refreshing what it holds still
    works. One machine then fills at most half of a node plus its share, and locking honest writers out takes
    a flood from about ``1 / (2 * sender_share)`` machines (8 with the default 1/16; a sender able to forge UDP
    source addresses still needs only one). While a node is under half
    full a sender may hold any amount: a swarm small enough that every node holds every record (one machine's
    server declaring thousands of experts) stays unaffected.
    """

    def __init__(self, max_subkeys: int = 256, max_expiration: float = 3600.0,
                 clock: Callable[[], float] = time.time, max_records: int = 1 << 16, max_entries: int = 1 << 19,
                 sender_share: float = 1 / 16):
        self.max_subkeys = max_subkeys
        self.max_expiration = max_expiration
        self.max_records = max_records
        #: entries of all records together: records times subkeys alone allowed 16.7M (~7 GiB of Python objects)
        self.max_entries = max_entries
        self.records_share = max(1, int(max_records * sender_share))
        self.entries_share = max(1, int(max_entries * sender_share))
        #: per sender group, the entries it stored that are held now, and the records its stores created
        self.entries_of: dict[str, int] = defaultdict(int)
        self.records_of: dict[str, int] = defaultdict(int)
        self._entry_senders: dict[bytes, dict[Subkey, str]] = {}  # per key and subkey, who stored the entry held
        self._record_senders: dict[bytes, str] = {}  # per key, whose store created the record
        self.clock = clock
        self.data: dict[bytes, Record] = {}
        self.entries = 0  # held now, expired ones included until they are dropped
        self._last_purge = float("-inf")
        #: per key, a number that changes whenever its live entries do (stored, replaced or expired), so that
        #: what is derived from a record (its encoded reply) can be reused until then
        self.versions: dict[bytes, int] = {}
        self._changes = 0
        #: per key, a time no later than its earliest expiration: until then nothing in it can have expired, so
        #: reading it needs no scan (nodes read records far more often than entries expire)
        self._soonest: dict[bytes, float] = {}
        #: per (key, owned subkey, owner), the (issue time, expiration) of the last entry held there after it
        #: expired, until no older entry of that owner can be live: an owner's latest entry wins (supersedes), and
        #: once it had expired a replay of an older, longer-lived one was taken again (a stopped server whose last
        #: run had a shorter --expiration came back at its old endpoint for up to an hour, review 89). At most
        #: ``max_entries`` of them, the oldest forgotten first.
        self._expired: dict[tuple[bytes, int, bytes], tuple[int, float]] = {}

    def store(self, key: bytes, subkey: Subkey, value: str, expiration: float, owner: bytes = b"",
              signature: bytes = b"", issued_us: int = 0, *, sender: str = "") -> bool:
        """Merges one entry; False if already expired, too far in the future (signed: more than ``max_expiration``
        and :data:`MAX_CLOCK_SKEW` ahead), issued after its expiration
        or more than :data:`MAX_CLOCK_SKEW` ahead of this node's clock, or older than what is held.

        Raises :class:`RecordFull` or :class:`NotOwner`. An unsigned expiration further than ``max_expiration``
        ahead is capped; a signed one cannot be re-dated without breaking its signature, so it is refused.
        Signatures are checked by the caller (the protocol), not here. ``sender``: the :func:`sender_group` of
        the machine that sent the store, whose share it counts against (``""``: this node or this machine).
        """
        now = self.clock()
        expiration = float(expiration)
        if signature:
            if self.out_of_time(expiration, issued_us):
                return False
        elif expiration > now + self.max_expiration:
            expiration = now + self.max_expiration
        if expiration <= now or not issue_time_fits(issued_us, expiration, now):
            return False
        record = self._live(key)
        if (isinstance(subkey, int) and owner and (record is None or subkey not in record)
                and (issued_us, expiration) <= self._expired.get((key, subkey, owner), (-1, 0.0))):
            return False  # older than an entry of its owner that expired here: a replay
        self._make_room(key, subkey, record, sender)
        if record is None or subkey not in record:
            record = self._live(key) if record is not None else None  # a purge may have dropped it
            if record is None:
                record = self.data[key] = {}
                self._record_senders[key] = sender
                self.records_of[sender] += 1
        before = record.get(subkey)
        stored = merge_entry(record, subkey, Entry(value, expiration, owner, signature, issued_us))
        if before is None and subkey in record:
            self.entries += 1
        if record.get(subkey) is not before:
            senders = self._entry_senders.setdefault(key, {})
            if before is not None:  # the entry is now the newer writer's
                self._forget(self.entries_of, senders.get(subkey, ""))
            senders[subkey] = sender
            self.entries_of[sender] += 1
            self._changed(key)
            self._soonest[key] = min(expiration, self._soonest.get(key, expiration))
        return stored

    def out_of_time(self, expiration: float, issued_us: int) -> bool:
        """Whether :meth:`store` drops a signed entry of these times whatever else it holds: expired, expiring more
        than ``max_expiration`` (and :data:`MAX_CLOCK_SKEW`: a writer's check allows it on its own clock, and one a
        little ahead of this node's had every node drop an entry of exactly ``max_expiration``, review 89) ahead, or
        issued after its expiration or too far ahead. Asked before a signature is checked (review 119)."""
        now = self.clock()
        return (expiration > now + self.max_expiration + MAX_CLOCK_SKEW or expiration <= now
                or not issue_time_fits(issued_us, expiration, now))

    def _make_room(self, key: bytes, subkey: Subkey, record: Record | None, sender: str) -> None:
        """Raises :class:`RecordFull` where a new record or entry of ``sender`` has no room (expired ones purged
        first, at most once a second); nothing for an entry that replaces one held."""
        if record is None:
            if len(self.data) >= self.max_records:
                self._purge()
                if len(self.data) >= self.max_records:
                    raise RecordFull(f"this node already holds {len(self.data)} records (max_records)")
            self._check_share(sender, "records", len(self.data), self.max_records, self.records_of,
                              self.records_share)
        if record is None or subkey not in record:
            if self.entries >= self.max_entries:
                self._purge()
                if self.entries >= self.max_entries:
                    raise RecordFull(f"this node already holds {self.entries} entries (max_entries)")
            self._check_share(sender, "entries", self.entries, self.max_entries, self.entries_of, self.entries_share)
            if record is not None and len(record) >= self.max_subkeys:
                raise RecordFull(f"record {key.hex()} already holds {len(record)} subkeys (max_record_subkeys)")

    def room_for(self, key: bytes, subkey: Subkey, sender: str = "") -> str | None:
        """Why a new entry of ``sender`` at ``subkey`` of ``key`` would be refused for room (:class:`RecordFull`'s
        message), or None: asked before its signature is checked, which costs far more (review 118)."""
        try:
            self._make_room(key, subkey, self._live(key), sender)
        except RecordFull as error:
            return str(error)
        return None

    def _check_share(self, sender: str, what: str, held: int, cap: int, of: dict[str, int], share: int) -> None:
        """Refuses a new record or entry of ``sender`` that holds its share of a node at least half full."""
        if sender and held >= cap // 2 and of.get(sender, 0) >= share:
            raise RecordFull(f"{sender} already holds {of[sender]} of the {held} {what} of this node, its share of a "
                             f"node over half full (max_{what} x sender_share)")

    @staticmethod
    def _forget(of: dict[str, int], sender: str) -> None:
        of[sender] -= 1
        if not of[sender]:
            del of[sender]

    def _changed(self, key: bytes) -> None:
        self._changes += 1
        self.versions[key] = self._changes

    def entry(self, key: bytes, subkey: Subkey) -> Entry | None:
        """The live entry at ``subkey`` of ``key``, if any."""
        entry = self.data.get(key, {}).get(subkey)
        return entry if entry is not None and entry.expiration > self.clock() else None

    def _purge(self) -> None:
        """Drops expired entries and records, at most once a second: a flood of stores into a full node must not
        buy a scan of every record each."""
        now = self.clock()
        if not self._last_purge <= now < self._last_purge + 1.0:
            self._last_purge = now
            for key in list(self.data):
                self._live(key)

    def _live(self, key: bytes) -> Record | None:
        record = self.data.get(key)
        if record is None:
            return None
        now = self.clock()
        if now < self._soonest.get(key, now):
            return record
        expired = [s for s, entry in record.items() if entry.expiration <= now]
        senders = self._entry_senders.get(key, {})
        for subkey in expired:
            self._remember(key, subkey, record.pop(subkey), now)
            self._forget(self.entries_of, senders.pop(subkey, ""))
        self.entries -= len(expired)
        if expired:
            self._changed(key)
        if not record:
            del self.data[key]
            self.versions.pop(key, None)
            self._soonest.pop(key, None)
            self._entry_senders.pop(key, None)
            self._forget(self.records_of, self._record_senders.pop(key, ""))
            return None
        self._soonest[key] = min(entry.expiration for entry in record.values())
        return record

    def _remember(self, key: bytes, subkey: Subkey, entry: Entry, now: float) -> None:
        """Keeps an expired owned entry's issue time while an older entry of its owner may still be live: one
        issued before it expires at most ``max_expiration`` (and the clock skew nodes allow) after that."""
        if not isinstance(subkey, int) or not entry.owner:
            return
        if entry.issued_us / 1_000_000 + self.max_expiration + MAX_CLOCK_SKEW <= now:
            return
        if len(self._expired) >= self.max_entries:
            horizon = (now - self.max_expiration - MAX_CLOCK_SKEW) * 1_000_000
            self._expired = {place: kept for place, kept in self._expired.items() if kept[0] > horizon}
            while len(self._expired) >= self.max_entries:  # still full: the oldest remembered go first
                del self._expired[next(iter(self._expired))]
        self._expired[(key, subkey, entry.owner)] = (entry.issued_us, entry.expiration)

    def live(self, key: bytes) -> Record | None:
        """The live entries of ``key`` (None when none are left) without copying them: the caller must not change
        them, nor keep them past its next store."""
        return self._live(key)

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
        """Merges a whole record (the ``IStorage`` seam); entries past the limits or of other owners are skipped."""
        for subkey, entry in record.items():
            try:
                self.store(key, subkey, *entry)
            except (RecordFull, NotOwner):
                continue

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, Record]]:
        """Nothing is ever republished by storage holders: owners refresh their own entries."""
        return []

    def __iter__(self) -> Iterator[tuple[bytes, Record]]:
        for key in list(self.data):
            record = self.get(key)
            if record is not None:
                yield key, record

    def __len__(self) -> int:
        return sum(1 for _ in self)
