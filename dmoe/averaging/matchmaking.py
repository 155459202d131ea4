"""Matchmaking: peers that want to average find each other under one DHT key and agree on one member list.

Every peer declares itself in record ``<prefix>.<round>.<group key>`` under its peer id for the round (an owned int
subkey, so nobody else can rewrite it), with its endpoint, its bandwidth, a salt and a state: ``w`` waiting, ``x``
gone, or ``L<n>.<nonce>`` leading a group of ``n``. The peer id is drawn afresh each round: a hash of the declarer's
DHT key (the entry's owner), the record's key and the salt (:func:`peer_id_for`), so nobody can tell it before the
peer declares, and readers skip entries whose subkey is not that hash of their owner. Round keys are predictable,
and the first key to store an int subkey owns it: an id kept across rounds (or one made from the DHT key and the
round's key alone, which anyone can compute) could be taken in the rounds to come by anyone, and that peer could
never declare again.

The **leader** is the smallest waiting peer id not yet taken by another group: once it sees ``target_group_size``
waiting peers (and ``margin`` after it declared itself), or when its ``matchmaking_time`` is up and it sees at least
``min_group_size``, it publishes the group in record
``<key>.<leader>.<nonce>`` (the group id): one entry per member (its endpoint, bandwidth and DHT key, which signs its
streams in the all-reduce), all owned by the leader's key, and once that is
stored, marks itself as leading. Everyone else polls the key: a peer listed in a leader's group joins it; a peer
left out of full groups waits for the next smallest waiting peer to lead (or leads itself). All members thus read
the same list, signed by one key. A peer that finds nobody by its deadline marks itself gone and averages with no
one.

A search may be given the peers it expects (``expected_peers``: their DHT keys, such as a collaboration's
partners): it then reads only their declarations and its own, so nobody else's records can lead it, hold it up as
a smaller waiting peer, take a place in its group, or make it give up. Anyone can store records under a round's
key ahead of time, declarations and groups of ids it signs itself included.

Waiting peers declare with short expirations (``declaration_ttl`` + ``margin``, plus :data:`CLOCK_SKEW` for the
clocks' skew) and renew them as they poll; readers judge a waiting declaration by its renewals on their own clock,
so a peer that dies while waiting stops holding the others up at most ``declaration_ttl`` + ``margin`` seconds later;
leaders take only peers whose declarations will live a little longer (``margin``), so that those still read the group
before giving up.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import math
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Mapping, Sequence

from dmoe.averaging.config import AveragerConfig
from dmoe.dht import DHT
from dmoe.endpoints import is_host_port

logger = logging.getLogger(__name__)

WAITING, GONE, LEADING = "w", "x", "L"
_LEADING = re.compile(r"L([0-9]{1,4})\.([0-9a-f]{8})")
_SALT = re.compile(r"[0-9a-f]{8}")
#: a member's DHT key (Ed25519, 32 bytes) as a group entry names it: unpadded base64url, 43 characters (in hex, 64
#: of the DHT's 96 per value, an IPv6 endpoint left the entry over the limit and the leader's step raised: review 98)
_KEY = re.compile(r"[A-Za-z0-9_-]{43}")  # ASCII: str.isdigit takes "²", which int refuses
#: largest peer id: ids are owned int subkeys of the DHT, which must lie in [0, 2**31)
MAX_PEER_ID = 2**31 - 1
#: seconds of clock skew a waiting declaration's expiration allows for: the DHT's nodes drop it by their own clocks
CLOCK_SKEW = 5.0
#: declarations tried, each under a new id, when the DHT refuses one (its id taken: only by chance or a lucky guess)
DECLARE_TRIES = 3


def new_peer_id() -> int:
    """A random peer id: the order of ids picks leaders, so it must not favour anyone."""
    return secrets.randbelow(MAX_PEER_ID) + 1


def new_salt() -> str:
    return secrets.token_hex(4)


def peer_id_for(owner: bytes, key: str, salt: str) -> int:
    """The peer id under which the DHT key ``owner`` declares itself in record ``key`` with ``salt``: in
    [1, MAX_PEER_ID], uniform, so the order of ids (which picks leaders) favours nobody who does not grind salts,
    and nobody can tell it before the peer declares (the salt is drawn afresh for every round)."""
    digest = hashlib.blake2b(b"%s\0%s\0%s" % (owner, key.encode(), salt.encode()), digest_size=8).digest()
    return int.from_bytes(digest, "big") % MAX_PEER_ID + 1


def key_text(key: bytes) -> str:
    """A DHT key as a group entry names it: unpadded base64url (43 characters for an Ed25519 key)."""
    return base64.urlsafe_b64encode(key).rstrip(b"=").decode()


@dataclass(frozen=True)
class Member:
    """One member of a group as the leader published it."""

    peer_id: int
    endpoint: str | None  # None: client mode, accepts no connections
    bandwidth: float       # 0 for client mode: owns no part
    key: bytes = b""       # its DHT key, which declared it: it signs its streams to the owners with it

    def describe(self) -> str:
        return f"{self.endpoint or '-'};{self.bandwidth:.6g}"

    def entry(self) -> str:
        """What a leader stores for this member in its group: ``<endpoint>;<bandwidth>;<DHT key, base64url>``. The
        key tells the owners whose signature a stream under this member's id must carry (anyone can read the ids)."""
        return f"{self.describe()};{key_text(self.key)}"


@dataclass(frozen=True)
class Group:
    """The outcome of matchmaking: the same for every member (they read it from one signed record)."""

    group_id: str                # the DHT key of the group record; begins with "<prefix>.<round>."
    round: int
    leader: int
    members: tuple[Member, ...]  # sorted by peer id: the order of the parts

    @property
    def peer_ids(self) -> tuple[int, ...]:
        return tuple(m.peer_id for m in self.members)


def parse_endpoint(text: str) -> str | None:
    """``HOST:PORT`` as declared, ``None`` for ``-`` (client mode); raises ValueError for anything else (a gRPC target
    such as ``unix:/run/x.sock`` too, which members would dial on their own machine: review 99 D3)."""
    if text == "-":
        return None
    if not is_host_port(text):
        raise ValueError(f"bad endpoint {text!r}")
    return text


def parse_member(peer_id: int, value: str) -> Member:
    """A member from ``<endpoint>;<bandwidth>`` (a group entry or the first two fields of a declaration)."""
    endpoint_text, _, bandwidth_text = value.partition(";")
    endpoint = parse_endpoint(endpoint_text)
    bandwidth = float(bandwidth_text)
    if not math.isfinite(bandwidth) or bandwidth < 0:
        raise ValueError(f"bad bandwidth {bandwidth_text!r}")
    return Member(peer_id, endpoint, bandwidth if endpoint is not None else 0.0)


def parse_group_entry(peer_id: int, value: str) -> Member:
    """A member from a group entry (:meth:`Member.entry`); raises ValueError for a malformed one (a group of a
    leader that lists no keys cannot average: its members' streams could not be authenticated)."""
    head, _, key_text = value.rpartition(";")
    if not _KEY.fullmatch(key_text):
        raise ValueError(f"bad member key {key_text!r}")
    return replace(parse_member(peer_id, head), key=base64.urlsafe_b64decode(key_text + "="))


def check_entry_fits(member: Member, max_value_bytes: int) -> None:
    """Raises ValueError naming the endpoint when a group entry of ``member`` (with an Ed25519 key) would be longer
    than the DHT takes: no leader could publish a group with this peer in it."""
    entry = replace(member, key=member.key or bytes(32)).entry()
    if len(entry) > max_value_bytes:
        raise ValueError(f"this peer's group entry {entry!r} is {len(entry)} bytes, over the DHT's max_value_bytes "
                         f"({max_value_bytes}): announce a shorter host than {member.endpoint!r}, or a bandwidth "
                         f"of fewer digits than {member.bandwidth!r}")


def published(member: Member) -> Member:
    """``member`` as the others read it from a record (the bandwidth rounded by :meth:`Member.describe`): every
    member, the leader included, must cut the parts from these very values, or the bounds differ by a value and
    every owner refuses every stream as the wrong size."""
    return replace(parse_member(member.peer_id, member.describe()), key=member.key)


def unworkable(members: Sequence[Member], me: Member) -> str | None:
    """Why a group read from the DHT cannot average, or None. A broken or hostile leader may publish anything: a
    group where nobody can own a part, or one that gives this peer a part though it accepts no connections."""
    if not any(m.bandwidth > 0 for m in members):
        return "no member accepts connections with a positive bandwidth, so nobody could own a part"
    listed = next((m for m in members if m.peer_id == me.peer_id), None)
    if listed is not None and listed.endpoint != me.endpoint:
        return (f"it lists this peer at {listed.endpoint or '- (client mode)'}, "
                f"not at {me.endpoint or '- (client mode)'} as it declared")
    if listed is not None and listed.key != me.key:
        return f"it lists this peer with DHT key {listed.key.hex()[:16]}, not its own"
    return None


@dataclass(frozen=True)
class Declaration:
    member: Member
    state: str
    expiration: float
    owner: bytes  # the declarer's DHT key: its peer id is peer_id_for(owner, key, salt)


def declaration_value(member: Member, salt: str, state: str) -> str:
    """What a peer stores under its id: ``<endpoint>;<bandwidth>;<salt>;<state>``."""
    return f"{member.describe()};{salt};{state}"


def parse_declarations(record: Mapping, key: str) -> dict[int, Declaration]:
    """The well-formed declarations of record ``key`` (int subkeys); malformed ones are skipped, and so are those
    whose subkey is not the id their owner's key makes with their salt (:func:`peer_id_for`): anyone may store
    under any free int subkey, but only the key that the id was made from declares under it."""
    found = {}
    for subkey, entry in record.items():
        if not isinstance(subkey, int) or isinstance(subkey, bool):
            continue
        try:
            head, salt, state = entry.value.rsplit(";", 2)
            member = replace(parse_member(subkey, head), key=entry.owner)
        except ValueError:
            logger.debug("skipping a malformed declaration %r of peer %s", entry.value, subkey)
            continue
        if not (state in (WAITING, GONE) or _LEADING.fullmatch(state)) or not _SALT.fullmatch(salt):
            logger.debug("skipping a malformed declaration %r of peer %s", entry.value, subkey)
        elif peer_id_for(entry.owner, key, salt) != subkey:
            logger.debug("skipping the declaration of peer %s by %s: not an id of that key", subkey,
                         entry.owner.hex()[:16])
        else:
            found[subkey] = Declaration(member, state, entry.expiration, entry.owner)
    return found


class Matchmaker:
    """Finds this peer's group for one round at a time through ``dht`` (see the module docstring).

    ``me``: this peer as it declares itself (its endpoint and bandwidth). Each search draws this peer's id for its
    round (:func:`peer_id_for` of the DHT's key, the round's key and a new salt): ``me.peer_id`` is then that id.
    ``stop`` (set by the averager's shutdown) ends a search early. Not thread-safe: one search at a time.
    """

    def __init__(self, dht: DHT, me: Member, config: AveragerConfig, stop: threading.Event):
        self.dht, self.me, self.config, self.stop = dht, published(me), config, stop
        self.salt = new_salt()  # of this peer's id in the current round
        self._expiration = 0.0  # of this peer's latest declaration: a later store must expire later to count
        self._ignored: set[str] = set()  # groups of this search refused as unworkable: said once, not every poll
        self._expected: frozenset[bytes] | None = None  # the DHT keys whose declarations this search reads
        self._seen_waiting: set[int] = set()  # peers this search saw waiting, in no group
        # pid -> (its waiting declaration's expiration, time.monotonic() when this search first read that one)
        self._seen_expiration: dict[int, tuple[float, float]] = {}
        self.clock: Callable[[], float] = time.time  # (a test's skewed clock)
        self.margin = max(1.0, 3 * config.poll_period)

    def _new_id(self, key: str) -> None:
        """Draws this peer's id in record ``key``: nobody can know it before this peer declares under it."""
        self.salt = new_salt()
        identity = self.dht.identity.public_key
        self.me = replace(self.me, peer_id=peer_id_for(identity, key, self.salt), key=identity)
        self._expiration = 0.0

    def _waiting_expiration(self) -> float:
        """When a declaration of this peer waiting expires unless renewed: soon, so that a peer that died stops
        holding up the others (a first declaration that lived the whole matchmaking time held up every peer of the
        key that long when its peer drew the smallest id and died, review 98 D3), and not before a leader that reads
        it a little later still takes it (``margin``)."""
        # (plus a clock skew's allowance: the DHT's nodes and the readers judge it by their own clocks, and one
        # a couple of seconds behind dropped out of every group: review 102; readers judge a declaration alive by
        # its renewals, on their own clock, not by its expiration: see _renewed)
        return self.clock() + max(self.config.declaration_ttl, 2 * self.config.poll_period) + self.margin + CLOCK_SKEW

    def _renewed(self, pid: int, declaration: Declaration) -> bool:
        """Whether the waiting ``declaration`` of ``pid`` was renewed (or first seen) within ``declaration_ttl`` +
        ``margin`` by this peer's clock (``time.monotonic``): its peer renews it every half ttl while it waits, and
        a peer that died stops holding up the others that long after its last renewal, whatever its expiration
        (which carries an allowance for skew) and whatever the clocks' skew."""
        now = time.monotonic()
        seen = self._seen_expiration.get(pid)
        if seen is None or seen[0] != declaration.expiration:
            seen = self._seen_expiration[pid] = (declaration.expiration, now)
        return now - seen[1] < max(self.config.declaration_ttl, 2 * self.config.poll_period) + self.margin

    def _keep_waiting(self, key: str) -> None:
        """Renews this peer's waiting declaration once half its ``declaration_ttl`` has passed (at every poll with a
        short one), so that it lives while this peer waits, whether for a smaller peer to lead or to fill its own
        group."""
        cfg = self.config
        if self._expiration - self.clock() < CLOCK_SKEW + self.margin + max(cfg.declaration_ttl / 2,
                                                                             2 * cfg.poll_period):
            self._declare(key, WAITING, self._waiting_expiration())

    def _declare(self, key: str, state: str, expiration: float) -> bool | str:
        """Stores this peer's declaration in ``key``; True when a DHT node took it, else False (none answered) or
        the reason a node gave for refusing it (its id owned by another key, a full record). Failures are logged:
        a peer the others cannot read is in no group."""
        self._expiration = max(expiration, self._expiration + 0.01)
        pid = self.me.peer_id
        try:
            result = self.dht.store_many({key: {pid: (declaration_value(self.me, self.salt, state),
                                                      self._expiration)}})[key][pid]
        except TimeoutError as error:
            logger.warning("could not declare peer %s in %s: %s", pid, key, error)
            return False
        if result is not True:
            logger.warning("could not declare peer %s in %s (%s): %s", pid, key, state,
                           result or "no DHT node took it")
        return result

    def find_group(self, round_number: int, key: str, deadline: float,
                   target_group_size: int | None = None, single_group: bool = False,
                   expected_peers: Collection[bytes] | None = None) -> Group | None:
        """This peer's group for the round, or None when it found nobody before the matchmaking time (plus the
        wait for smaller peers that were still alive) or the wall-clock ``deadline`` (``time.time()``) ran out. A
        leader short of its target forms its group with whoever came by the matchmaking time or, when that is sooner,
        a quarter of the search's time (at least ``margin``) before the deadline, which leaves that to the all-reduce.

        ``target_group_size`` overrides the config's for this round (a caller that knows how many peers will come,
        such as a collaboration that counts its trainers, lets the leader form the group as soon as they are there).
        ``expected_peers``: the DHT keys of the peers this round is meant for (besides this one): only their
        declarations are read (see the module docstring).
        ``single_group``: the round is meant to have one group of everyone (a collaboration's step), so a peer that
        finds a group formed without it and nobody else waiting is late and gives up at once, instead of waiting
        out the matchmaking time for a group of its own that nobody will join. Such a group must be one this peer
        could have been in: led by an expected peer, or, with no ``expected_peers``, holding a peer this search saw
        waiting. Anyone can store a "group" of ids it signs itself under a round's key ahead of time; one that
        made peers give up made every trainer of a collaboration give up at every step.
        """
        cfg = self.config
        target = cfg.target_group_size if target_group_size is None else target_group_size
        start = self.clock()
        # a leader short of its target forms its group by the deadline at the latest, leaving the all-reduce a quarter
        # of the search's time (at least `margin`): one that waited out a matchmaking_time past the deadline of a
        # step(timeout=...) never averaged unless its group was full (review 98 D4)
        matchmaking_ends = min(start + cfg.matchmaking_time, deadline - max(self.margin, (deadline - start) / 4))
        for _ in range(DECLARE_TRIES):  # a refused id (taken by chance, or by a lucky guess) is replaced
            self._new_id(key)
            if not isinstance(self._declare(key, WAITING, self._waiting_expiration()), str):
                break
        self._expected = None if expected_peers is None else frozenset(expected_peers) | {
            self.dht.identity.public_key}
        self._seen_waiting = set()
        self._seen_expiration = {}
        # no group is led before the peers that declared about when this one did can be read: a leader that formed a
        # full group at once with the waiting peers it saw first could take one that a smaller peer, declared but not
        # yet readable, took too (two groups claiming one peer: one of them fails its all-reduce). A round of one
        # group of everyone needs no wait: its leader sees all the peers it expects
        settled = min(self.clock() + self.margin, matchmaking_ends) if not single_group else 0.0
        self._ignored.clear()
        groups: dict[int, Group] = {}  # leader id -> group read completely
        unreadable: dict[int, float] = {}  # leader id -> since when its group could not be read in full
        redraws = 0
        while not self.stop.is_set() and self.clock() < deadline:
            try:
                record = self.dht.get(key)
                declarations = parse_declarations(record, key)
            except TimeoutError as error:
                logger.debug("matchmaking read of %s failed: %s", key, error)
                declarations = None
            else:
                mine = record.get(self.me.peer_id)
                if mine is not None and mine.owner != self.dht.identity.public_key and redraws < DECLARE_TRIES:
                    # a store counts as accepted when any replica takes it: one that some replicas took while most
                    # held another key's entry under this id (stored ahead, by chance or a lucky guess) is read as
                    # that entry, and skipped, by everyone; a peer nobody sees would wait out the round alone
                    redraws += 1
                    logger.warning("peer %s in %s: the DHT nodes read give its id to another key; declaring under a "
                                   "new id", self.me.peer_id, key)
                    self._new_id(key)
                    self._declare(key, WAITING, self._waiting_expiration())
                    continue
            if declarations is not None and self._expected is not None:
                declarations = {pid: d for pid, d in declarations.items() if d.owner in self._expected}
            if declarations is not None:
                outcome = self._look(round_number, key, declarations, groups, unreadable, matchmaking_ends, target,
                                     single_group, settled)
                if outcome is not _WAIT:
                    return outcome
            self._keep_waiting(key)
            self.stop.wait(cfg.poll_period * random.uniform(0.75, 1.25))
        self._declare(key, GONE, self._expiration)
        return None

    def _look(self, round_number: int, key: str, declarations: dict[int, Declaration], groups: dict[int, Group],
              unreadable: dict[int, float], matchmaking_ends: float, target: int,
              single_group: bool = False, settled: float = 0.0) -> "Group | None | object":
        """One look at the key's declarations: a group to join, one led now, None (gave up) or _WAIT."""
        cfg, me = self.config, self.me.peer_id
        leaders = {pid: d for pid, d in declarations.items() if d.state.startswith(LEADING)}
        unread = [pid for pid in leaders if pid not in groups]
        if unread:
            self._read_groups(round_number, key, {pid: leaders[pid] for pid in unread}, groups)
        for leader in sorted(groups):
            if me in groups[leader].peer_ids:
                return groups[leader]
        now = self.clock()
        for pid in leaders:
            if pid not in groups:
                unreadable.setdefault(pid, now)
        # a group not readable in full yet: who it took is unknown, so wait; but not for long, a leader that
        # published a malformed group (or died half-way) must not hold up every larger peer
        if any(pid not in groups and now - unreadable[pid] < self.margin for pid in leaders):
            return _WAIT
        taken = {pid for group in groups.values() for pid in group.peer_ids}
        waiting = {pid: d for pid, d in declarations.items()
                   if d.state == WAITING and pid not in taken and self._renewed(pid, d)}
        waiting.pop(me, None)
        if single_group and not waiting:
            # a group this peer could have been in: led by a peer it expects, or one it saw waiting in this search
            # (ids are new in every round, so nobody could have put such a peer into a group stored ahead of time)
            late = [group for group in groups.values() if self._expected is not None
                    or any(pid in self._seen_waiting for pid in group.peer_ids)]
            if late:
                logger.info("matchmaking in %s: group %s formed without this peer; it came too late", key,
                            late[0].group_id)
                self._declare(key, GONE, now + cfg.declaration_ttl)
                return None
        self._seen_waiting.update(waiting)
        if any(pid < me for pid in waiting):  # a smaller peer leads; stay visible until it does (_keep_waiting)
            return _WAIT
        # this peer leads: the smallest waiting peer that no group has taken (and that a group entry can hold: a
        # declaration of a long endpoint fits the DHT's values without the key the entry adds, and made the store of
        # the group raise in this peer's step)
        available = [self.me] + [d.member for pid, d in sorted(waiting.items()) if d.expiration > now + self.margin
                                 and len(d.member.entry()) <= self.dht.config.max_value_bytes]
        if (len(available) < target or now < settled) and now < matchmaking_ends:
            return _WAIT
        members = available[:target]
        if len(members) < cfg.min_group_size or not any(m.endpoint for m in members):
            logger.info("matchmaking in %s: found %d peer(s) that can average, giving up", key, len(members))
            self._declare(key, GONE, now + cfg.declaration_ttl)
            return None
        return self._lead(round_number, key, members)

    def _lead(self, round_number: int, key: str, members: list[Member]) -> Group | None:
        cfg = self.config
        nonce = secrets.token_hex(4)
        group_id = f"{key}.{self.me.peer_id}.{nonce}"
        expiration = self.clock() + cfg.matchmaking_time + cfg.declaration_ttl + 10.0
        self._expiration = max(expiration, self._expiration + 0.01)
        state = f"{LEADING}{len(members)}.{nonce}"
        try:
            # the group before the declaration that points to it: stored together, a peer could read the declaration
            # first, wait `margin` in vain for the group, go on as if this leader took nobody, and lead a group of
            # its own with one of this group's members (on a loaded DHT, a record can take seconds to be readable)
            results = self.dht.store_many({group_id: {m.peer_id: (m.entry(), expiration) for m in members}})
            if all(result is True for result in results[group_id].values()):
                results |= self.dht.store_many(
                    {key: {self.me.peer_id: (declaration_value(self.me, self.salt, state), self._expiration)}})
        except (TimeoutError, ValueError) as error:  # (ValueError: an entry the DHT refuses before sending it)
            results = {"error": {0: str(error)}}
        failed = [f"{subkey}: {result}" for record in results.values() for subkey, result in record.items()
                  if result is not True]
        if failed:
            logger.warning("could not publish group %s (%s); averaging with no one", group_id, ", ".join(failed))
            self._declare(key, GONE, self.clock() + cfg.declaration_ttl)
            return None
        # the values the others read from the record, not this peer's own: they cut the parts from those
        members = sorted((published(m) for m in members), key=lambda m: m.peer_id)
        logger.info("leading group %s of %d", group_id, len(members))
        return Group(group_id, round_number, self.me.peer_id, tuple(members))

    def _read_groups(self, round_number: int, key: str, leaders: dict[int, Declaration],
                     groups: dict[int, Group]) -> None:
        """Reads the groups of ``leaders``; keeps those readable in full (every entry signed by the leader) that can
        average. The others stay unread: after ``margin``, the search goes on as if their leaders took nobody."""
        ids = {pid: f"{key}.{pid}.{_LEADING.fullmatch(d.state).group(2)}" for pid, d in leaders.items()}
        try:
            records = self.dht.get_many(list(ids.values()))
        except TimeoutError as error:
            logger.debug("reading groups failed: %s", error)
            return
        for pid, group_id in ids.items():
            declaration = leaders[pid]
            size = int(_LEADING.fullmatch(declaration.state).group(1))
            members, malformed = [], []
            for subkey, entry in records.get(group_id, {}).items():
                if isinstance(subkey, int) and entry.owner == declaration.owner:  # others may write there too
                    try:
                        members.append(parse_group_entry(subkey, entry.value))
                    except ValueError:
                        malformed.append(subkey)
            problem = f"malformed entries of peers {sorted(malformed)}" if malformed else None
            if problem is None and len(members) == size and pid in {m.peer_id for m in members}:
                problem = unworkable(members, self.me)
                if problem is None:
                    groups[pid] = Group(group_id, round_number, pid, tuple(sorted(members, key=lambda m: m.peer_id)))
            if problem is not None:
                logger.log(logging.DEBUG if group_id in self._ignored else logging.WARNING,
                           "ignoring group %s of peer %s: %s", group_id, pid, problem)
                self._ignored.add(group_id)


_WAIT = object()
