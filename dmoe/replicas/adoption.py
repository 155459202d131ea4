"""Adoption: when an expert's declaration expires (its server left), a server holding its replica starts serving
it under the same uid, from the newest replica anyone holds.

Every ``check_period`` the :class:`Adopter` announces what its server holds (``{uid}/replicas``) and that it
receives replicas (``{layer}/replica-hosts``), and looks up the cells of the experts it holds replicas of. A cell
found empty is adopted after ``stagger`` seconds per holder ranked before this one (most updates first, then the
closest to the expert's key; only holders whose signed header was seen count, one per machine, see
:meth:`Adopter.rank`), so the holder of the newest replica usually goes first and the others find the cell served
when their turn comes. Adopting means:

1. fetching the newest replica that verifies (this server's own, or another holder's: its signature, its bytes,
   its signer one this server trusts with the expert (:func:`expected_signers`), its state fitting this server's
   experts), newest by its signed update count: every holder is asked for its replica's header at once, and only
   those whose signed header shows a newer replica are fetched (:func:`newest_replica`);
2. loading it into a new backend (:attr:`ExpertServer.backend_factory`);
3. claiming the uid (:func:`claim`): declaring it, then reading the directory back. A uid's entry is owned by the
   first key that stores it until it expires, and readers side with the owner most replicas hold, so of two
   servers that claim at once, both read the same winner and only it goes on;
4. serving it (:meth:`ExpertServer.add_expert`, which announces it) and noting the adoption in
   ``{layer}/adopted`` for the live swarm page.

A new server that chooses a cell (``--num-experts``) does step 1-2 before it serves (:func:`restore_newest`); its
first declaration is its claim, and :func:`drop_unowned` stops it serving any cell another server owns; of two that
chose one cell at once and whose declarations tie (readers find nobody), one gives way (:meth:`Adopter._give_way`).
An expert with no replica anywhere starts fresh, which is logged as lost training.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

import grpc

from dmoe.dht import DHT
from dmoe.dht.storage import Entry
from dmoe.directory import declare_experts
from dmoe.replicas.metrics import ReplicaMetrics
from dmoe.replicas.pusher import ReplicaChannels, ReplicaError, check_wanted, fetch_headers, fetch_snapshot
from dmoe.replicas.records import (
    ADOPTION_MEMORY,
    SIGNER_HEX,
    Adoption,
    Holder,
    adopted_key,
    cell_subkey,
    directory_entries,
    distance,
    holder_machine,
    holders,
    host_value,
    hosts_key,
    replicas_key,
    server_subkey,
)
from dmoe.replicas.snapshots import (
    SignedSnapshot,
    SnapshotRefused,
    check_state,
    load_into,
    max_snapshot_bytes,
    max_tensors,
    open_body,
    sign,
    take,
)
from dmoe.replicas.store import HeldReplica, ReplicaStore
from dmoe.server.backend import ExpertBackend
from dmoe.server.checkpoints import to_host
from dmoe.uid import split_uid
from dmoe.wire import dmoe_pb2

if TYPE_CHECKING:
    from dmoe.server import ExpertServer

logger = logging.getLogger(__name__)


def claim(dht: DHT, uids: Sequence[str], endpoint: str, expiration: float, confirm_after: float = 0.5) -> list[str]:
    """Declares ``uids`` at ``endpoint`` and returns those this node's identity owns: the directory must name it the
    owner twice, ``confirm_after`` seconds apart (a rival's store may still be on its way at the first read). The
    loser of a race stores nothing more, so its stray entries expire within ``expiration`` (:class:`Adopter` does
    not claim a uid again before they have, see :func:`claim_stored`)."""
    return claim_stored(dht, uids, endpoint, expiration, confirm_after)[1]


def claim_stored(dht: DHT, uids: Sequence[str], endpoint: str, expiration: float,
                 confirm_after: float = 0.5) -> tuple[list[str], list[str]]:
    """:func:`claim`, returning (the uids whose declaration the DHT stored, those of them this node owns). A stored
    declaration lives ``expiration`` seconds, won or lost: when two claims split the replicas of a uid's entry
    evenly, readers find no owner (a tie reads as no entry, see :func:`dmoe.dht.storage.merge_records`), both
    lose, and a loser that claimed again at its next look refreshed its half, so the tie lasted for as long as
    both ran (review 88)."""
    me = dht.identity.public_key
    stored = [uid for uid, ok in zip(uids, declare_experts(dht, list(uids), endpoint, expiration)) if ok]
    won = stored
    for attempt in range(2):
        if not won:
            break
        if attempt:
            time.sleep(confirm_after)
        entries = directory_entries(dht, won)
        won = [uid for uid in won if entries[uid] is not None and entries[uid].owner == me]
    return stored, won


def read_holders(dht: DHT, uids: Sequence[str]) -> dict[str, list[Holder]]:
    """Who announced a replica of each of ``uids`` (one batched look-up); nobody, where the DHT did not answer."""
    try:
        records = dht.get_many([replicas_key(uid) for uid in uids])
    except Exception as error:  # noqa: BLE001 - the DHT may be unreachable for a moment: use what is held
        logger.warning("could not read who holds replicas of %d experts: %s", len(uids), error)
        return {uid: [] for uid in uids}
    return {uid: holders(records[replicas_key(uid)]) for uid in uids}


#: replicas fetched from other holders, at most, before adoption settles for the best verified so far. Every
#: holder is first asked for its replica's header (signed: the update count it shows is real), side by side; only
#: those whose header shows a newer replica than the best so far are fetched, newest first, and each such fetch
#: (a whole replica's bytes, maybe) counts
MAX_FETCHES = 3
#: seconds every holder has to show its replica's header (all are asked at once, so this is what holders that
#: never answer cost an adoption, however many of them are announced; a holder sends it at once, from its disk)
PROBE_TIMEOUT = 3.0
#: seconds :meth:`Adopter.close` waits for the adopter's thread. Its probes and fetches end at the stop (within
#: :data:`~dmoe.replicas.pusher.STOP_POLL`); what may remain is a DHT look-up or a claim under way, each bounded by
#: the DHT's timeouts. Waited for without a bound, a fetch from a holder that trickles its bytes held a clean stop
#: up to a minute per fetch, and a supervisor's SIGKILL then lost the server's last push (review 88)
CLOSE_TIMEOUT = 5.0


class Verified(NamedTuple):
    """A replica that verified: signed by the expected key, its bytes intact, its state fitting this server."""
    signed: SignedSnapshot
    snapshot: object
    state: object

    @property
    def updates(self) -> int:
        return self.signed.header.updates


def expected_signers(own: dmoe_pb2.ReplicaHeader | None, owner: bytes | None, me: bytes,
                     vouched: str | None = None) -> set[str]:
    """The keys (hex prefixes) whose replicas of an expert this server takes, each for a reason nobody can fake:

    * ``me``, this server's own: nobody else can sign with it, and what it signed is training it did (an adopter
      that restarted finds its own later replicas on other servers);
    * ``owner``, the key that owns the uid in the directory now, if anyone does: holders take pushes from it
      alone, and the entry is the strongest evidence of whose the expert is;
    * the signer of ``own``, the replica held here: this server took it from the owner of its time;
    * only when neither of the last two names anyone (a new server taking a cell that emptied, whose replica it
      does not hold): ``vouched``, the signer that the most holder *machines* serve replicas of
      (:func:`vouched_signer`). Trusting the signer that the most ``{uid}/replicas`` entries named let throwaway
      keys, which cost nothing, outvote the honest holders and get an attacker's snapshot adopted.
    """
    signers = {me.hex()[:SIGNER_HEX]}
    if owner is not None:
        signers.add(owner.hex()[:SIGNER_HEX])
    if own is not None:
        signers.add(own.signer.hex()[:SIGNER_HEX])
    if owner is None and own is None and vouched is not None:
        signers.add(vouched)
    return signers


def most_vouched(served: Mapping[str, str]) -> str | None:
    """Of the signers in ``served`` (holder endpoint -> the signer of the replica it served), the one served from
    the most machines (:func:`~dmoe.replicas.records.holder_machine`), each counted once however many endpoints or
    keys it has; None when none is, or two tie (nothing tells which holders are honest then)."""
    machines: dict[str, set[str]] = defaultdict(set)
    for endpoint, signer in served.items():
        machine = holder_machine(endpoint)
        if machine is not None:
            machines[signer].add(machine)
    counts = sorted(((len(found), signer) for signer, found in machines.items()), reverse=True)
    if not counts or (len(counts) > 1 and counts[0][0] == counts[1][0]):
        return None
    return counts[0][1]


def vouched_signer(uid: str, announced: Sequence[Holder], channels: ReplicaChannels, *, max_bytes: int,
                   timeout: float = PROBE_TIMEOUT, stop: threading.Event | None = None) -> str | None:
    """The signer (key prefix) of ``uid``'s replicas that the most machines among the holders vouch for, or None.

    An entry of ``{uid}/replicas`` costs a key, which costs nothing, and may name any endpoint, so entries are not
    votes: every endpoint they name is asked for its replica's header (signature checked, the bytes never fetched),
    and a machine vouches for the signer of what it served. An attacker then needs more machines serving its
    snapshot than the expert has honest holders; honest holders only ever hold replicas signed by the key that
    owned the uid in the directory when they took them. One entry per holder (the record's subkey cap) bounds the
    endpoints asked; they are all asked at once, within ``timeout`` seconds (:func:`fetch_headers`; ``stop`` set
    ends the wait)."""
    endpoints = sorted({holder.endpoint for holder in announced})
    if not endpoints:
        return None
    served = {}
    for endpoint, header in fetch_headers(channels, uid, endpoints, max_bytes=max_bytes, timeout=timeout,
                                          stop=stop).items():
        if isinstance(header, Exception):
            logger.debug("%s vouches for no replica of %s: %s", endpoint, uid, header)
        else:
            served[endpoint] = header.signer.hex()[:SIGNER_HEX]
    chosen = most_vouched(served)
    if chosen is None and served:
        logger.warning("the holders of %s's replicas serve replicas of %d signers, none from more machines than "
                       "the others: trusting none of them", uid, len(set(served.values())))
    return chosen


def check_replica(signed: SignedSnapshot, signers: set[str], template: ExpertBackend) -> Verified:
    """``signed`` opened and checked against ``template``; raises SnapshotRefused (or ValueError) if it is of no
    use. The signature itself was checked when the header arrived (:func:`fetch_snapshot`, the store's push)."""
    if signed.header.signer.hex()[:SIGNER_HEX] not in signers:
        raise SnapshotRefused(grpc.StatusCode.PERMISSION_DENIED, "not_owner", f"signed by "
                              f"{signed.header.signer.hex()[:SIGNER_HEX]}, not {' or '.join(sorted(signers))}")
    snapshot = open_body(signed, max_tensors(template))
    return Verified(signed, snapshot, check_state(snapshot, template))


def newest_replica(dht: DHT, uid: str, template: ExpertBackend, channels: ReplicaChannels, *, max_bytes: int,
                   store: ReplicaStore | None = None, announced: list[Holder] | None = None, timeout: float = 60.0,
                   max_fetches: int = MAX_FETCHES, owner: bytes | None = None,
                   probe_timeout: float = PROBE_TIMEOUT, stop: threading.Event | None = None) -> Verified | None:
    """The replica of ``uid`` whose signed header counts the most updates among those that verify, as (signed,
    snapshot, checked state), or None.

    Candidates: what ``store`` holds and what the holders announced in the DHT (``announced``: read now if None).
    The replica held here is looked at first (it costs no fetch), and a held replica is never traded for one with
    fewer updates. Any key can announce any count at any endpoint, so announced counts only choose whom to ask
    (those announcing more than the replica held here): every one is asked for its replica's header, all at once
    within ``probe_timeout`` (:func:`~dmoe.replicas.pusher.fetch_headers`), and the replicas whose signed headers
    show more updates than the best so far are fetched, newest first (at equal counts, holders that announced what
    they hold first), at most ``max_fetches`` of them. Holders asked one after another, each fetch counting when
    slower than a second, let a few throwaway entries at endpoints that never answer stall an adoption for minutes
    and keep a new server from ever reaching the honest holder (review 59). Only replicas signed by a key
    :func:`expected_signers` names count; ``owner``: the key that owns ``uid`` in the directory now (None:
    nobody). Holding no replica and finding no owner, this server asks the holders which signer their machines
    vouch for (:func:`vouched_signer`) when their entries name more than one. A replica larger than any snapshot of
    ``template``'s experts can be (:func:`~dmoe.replicas.snapshots.max_snapshot_bytes`) is refused at its header.
    ``stop`` set (the server stopping) cancels the probes and fetches under way and starts no more: what was found
    so far is returned.
    """
    own = store.header(uid) if store is not None else None
    max_bytes = min(max_bytes, max_snapshot_bytes(template))
    if announced is None:
        announced = read_holders(dht, [uid])[uid]
    me = dht.identity.public_key
    announced = [holder for holder in announced if holder.holder != me]
    vouched = None
    named = {holder.signer for holder in announced}
    if own is None and owner is None and named:
        # one signer named: nobody to outvote (its replicas are still verified when fetched)
        vouched = named.pop() if len(named) == 1 else vouched_signer(uid, announced, channels, max_bytes=max_bytes,
                                                                     stop=stop)
    signers = expected_signers(own, owner, me, vouched)
    best = _try(uid, None, signers, template, channels, store, max_bytes, timeout, None) if own is not None else None
    fetches = 0
    for endpoint, header in _newer_headers(uid, announced, signers, channels, max_bytes, probe_timeout,
                                           best.updates if best is not None else None, stop):
        if best is not None and header.updates <= best.updates:
            break  # (sorted: nobody after it holds more either)
        if stop is not None and stop.is_set():
            break
        if fetches >= max_fetches:
            logger.warning("gave up looking for a newer replica of %s after %d fetches", uid, fetches)
            break
        fetches += 1
        found = _try(uid, endpoint, signers, template, channels, store, max_bytes, timeout,
                     best.updates if best is not None else None, stop)
        if found is not None and (best is None or found.updates > best.updates):
            best = found
    if best is not None and own is not None and best.updates < own.updates:
        logger.warning("the replica of %s held here (%d updates) is of no use: taking one with %d", uid,
                       own.updates, best.updates)
    return best


def _newer_headers(uid: str, announced: Sequence[Holder], signers: set[str], channels: ReplicaChannels,
                   max_bytes: int, timeout: float, newer_than: int | None,
                   stop: threading.Event | None = None) -> list[tuple[str, dmoe_pb2.ReplicaHeader]]:
    """(endpoint, header) of the holders in ``announced`` that serve a replica signed by one of ``signers`` with
    more updates than ``newer_than`` (None: any), most updates first; asked side by side, each holder once,
    those announcing no more than ``newer_than`` not at all."""
    counts: dict[str, set[int]] = defaultdict(set)  # endpoint -> the counts entries announced at it
    for holder in announced:
        if holder.signer in signers and (newer_than is None or holder.updates > newer_than):
            counts[holder.endpoint].add(holder.updates)
    if not counts:
        return []
    found, useless = [], []
    for endpoint, header in fetch_headers(channels, uid, counts, max_bytes=max_bytes, timeout=timeout,
                                          stop=stop).items():
        try:
            if isinstance(header, Exception):
                raise header
            check_wanted(header, endpoint, signers, newer_than)
        except (ReplicaError, SnapshotRefused, ValueError) as error:
            logger.debug("%s's replica of %s is of no use: %s", endpoint, uid, error)
            useless.append(f"{endpoint} ({error})")
            continue
        if header.updates < max(counts[endpoint]):
            logger.warning("%s announced a replica of %s with %d updates but holds one with %d", endpoint, uid,
                           max(counts[endpoint]), header.updates)
        found.append((endpoint, header))
    if useless and not (stop is not None and stop.is_set()):  # (one line: any key may announce many)
        logger.info("%d of %d holders of %s showed no newer replica it could use, e.g. %s", len(useless),
                    len(counts), uid, useless[0])
    # (stable: at equal counts, holders that announced what they hold first, then in the order announced)
    found.sort(key=lambda item: (-item[1].updates, item[1].updates not in counts[item[0]]))
    return found


def _try(uid: str, endpoint: str | None, signers: set[str], template: ExpertBackend, channels: ReplicaChannels,
         store: ReplicaStore | None, max_bytes: int, timeout: float, newer_than: int | None,
         stop: threading.Event | None = None) -> Verified | None:
    """The replica of ``uid`` held at ``endpoint`` (None: the one held here, in ``store``), verified, or None when
    it is of no use (logged); ``newer_than``: the updates of the best replica found so far (a fetched one with no
    more is cancelled at its header); ``stop`` set cancels the fetch."""
    try:
        if endpoint is None:
            signed = store.get(uid)
            return check_replica(signed, signers, template) if signed is not None else None
        signed = fetch_snapshot(channels.stub(endpoint), endpoint, uid, max_bytes=max_bytes, timeout=timeout,
                                signers=signers, newer_than=newer_than, stop=stop)
        return check_replica(signed, signers, template)
    except Exception as error:  # noqa: BLE001 - see below
        if stop is not None and stop.is_set():
            logger.info("stopping: the fetch of %s's replica of %s was given up", endpoint, uid)
            return None
        # any exception, not only the expected ones: the snapshot is untrusted input, and one the checks did not
        # foresee (an OverflowError from a +inf step count) crashed a new server's restore and aborted adoptions
        # (review 78)
        where = "this server's own" if endpoint is None else f"{endpoint}'s"
        expected = isinstance(error, (ReplicaError, SnapshotRefused, OSError, ValueError))
        logger.warning("%s replica of %s is of no use: %s", where, uid,
                       error if expected else f"{type(error).__name__}: {error}")
        return None


def restore_newest(server: "ExpertServer", dht: DHT, uids: Sequence[str], channels: ReplicaChannels, *,
                   max_bytes: int, store: ReplicaStore | None = None,
                   metrics: ReplicaMetrics | None = None) -> dict[str, Adoption]:
    """Before ``server`` serves: loads into each of ``uids`` the newest replica anyone holds, when it has more
    updates than the expert has now (restored from a checkpoint, or fresh); returns uid -> the adoption, to be
    noted once the server owns the uid. Experts left fresh with no replica anywhere are logged as lost training."""
    loaded, fresh = {}, []
    announced = read_holders(dht, uids)
    owners = directory_owners(dht, uids)
    for uid in uids:
        backend = server.backends[uid]
        # each uid on its own: a replica that fails in a way no check foresaw costs that expert its replica, not
        # the server its start (an OverflowError here used to kill dmoe-server before it served; review 78)
        try:
            found = newest_replica(dht, uid, backend, channels, max_bytes=max_bytes, store=store,
                                   announced=announced[uid], owner=owners.get(uid))
        except Exception:  # noqa: BLE001 - logged; the expert starts as it is
            logger.exception("looking for the newest replica of %s failed: it starts from %s", uid, _as_is(backend))
            continue
        if found is None:
            if backend.updates == 0:
                fresh.append(uid)
            continue
        signed, snapshot, state = found
        if snapshot.updates > backend.updates:
            try:
                _load_or_undo(backend, snapshot, state)
            except Exception as error:  # noqa: BLE001 - logged; the expert starts as it was
                logger.warning("the newest replica of %s (%d updates, signed by %s) cannot be loaded (%s: %s): it "
                               "starts from %s", uid, snapshot.updates, signed.header.signer.hex()[:SIGNER_HEX],
                               type(error).__name__, error, _as_is(backend))
                continue
            loaded[uid] = Adoption(uid, time.time(), snapshot.updates, snapshot.backward_calls)
            logger.info("%s starts from its newest replica: %d updates (signed by %s)", uid, snapshot.updates,
                        signed.header.signer.hex()[:SIGNER_HEX])
    if fresh:
        logger.warning("no replica anywhere of %d experts (%s): they start from fresh weights, and whatever they "
                       "trained before, if they ever served, is lost", len(fresh), ", ".join(fresh[:8]))
        if metrics is not None:
            metrics.started_fresh.inc(len(fresh))
    return loaded


def _as_is(backend: ExpertBackend) -> str:
    return f"its checkpoint ({backend.updates} updates)" if backend.updates else "fresh weights"


def _load_or_undo(backend: ExpertBackend, snapshot: dmoe_pb2.Snapshot, state: object) -> None:
    """:func:`load_into`, or, when it fails half way (the module loaded, the optimizer state refused), the backend
    put back as it was: a server's own expert, restored from its checkpoint maybe, must not start half replaced."""
    before = to_host(backend.state_dict())
    counters = backend.updates, backend.forward_calls, backend.backward_calls
    try:
        load_into(backend, snapshot, state)
    except BaseException:
        backend.load_state_dict(before)
        backend.updates, backend.forward_calls, backend.backward_calls = counters
        raise


def directory_owners(dht: DHT, uids: Sequence[str]) -> dict[str, bytes]:
    """uid -> the key that owns its directory entry now, for those of ``uids`` someone declares (none, where the
    DHT did not answer: the signers are then found as for a cell nobody serves)."""
    try:
        entries = directory_entries(dht, list(uids))
    except Exception as error:  # noqa: BLE001 - the holders are asked instead
        logger.warning("could not read the directory entries of %d experts: %s", len(uids), error)
        return {}
    return {uid: entry.owner for uid, entry in entries.items() if entry is not None}


def note_adoptions(dht: DHT, adoptions: Sequence[Adoption]) -> None:
    """Writes adoptions into their layers' ``adopted`` records, where the live swarm page (and bench_churn) read
    them for an hour."""
    records: dict[str, dict] = {}
    for adoption in adoptions:
        subkey = cell_subkey(adoption.uid)
        if subkey is not None:
            records.setdefault(adopted_key(split_uid(adoption.uid)[0]), {})[subkey] = (
                adoption.value(), adoption.at + ADOPTION_MEMORY)
    if not records:
        return
    try:
        dht.store_many(records)
    except Exception as error:  # noqa: BLE001 - only the swarm page reads them
        logger.info("could not note %d adoptions in the DHT: %s", len(adoptions), error)


def drop_unowned(server: "ExpertServer", dht: DHT) -> list[str]:
    """Stops serving the experts whose uid another key owns in the directory (another server serves them, or
    adopted them first); returns those uids. Uids nobody owns yet are kept: their declaration is on its way."""
    uids = list(server.backends)
    if not uids:
        return []
    me = dht.identity.public_key
    entries = directory_entries(dht, uids)
    dropped = [uid for uid in uids if entries[uid] is not None and entries[uid].owner != me]
    for uid in dropped:
        server.remove_expert(uid)
        logger.warning("%s is owned by another server (%s, at %s): not serving it", uid,
                       entries[uid].owner.hex()[:SIGNER_HEX], entries[uid].value)
    return dropped


class Adopter:
    """Announces what ``server`` holds and adopts the experts whose cells empty; one thread, stopped by
    :meth:`close`.

    Args:
        server: serves what is adopted (its ``backend_factory`` builds the expert; its announcer's ``endpoint``
            and ``expiration`` are used for every record).
        dht: the server's DHT node (its identity owns the server's entries).
        store: the replicas held.
        layers: layers whose replicas this server receives (announced as a host of each).
        check_period: seconds between looks at the cells (and announcements).
        stagger: seconds a holder waits per holder ranked before it.
    """

    def __init__(self, server: "ExpertServer", dht: DHT, store: ReplicaStore, layers: Sequence[str], *,
                 check_period: float, stagger: float, channels: ReplicaChannels, metrics: ReplicaMetrics | None = None,
                 max_bytes: int, expiration: float, machine: str | None = None):
        self.server, self.dht, self.store, self.layers = server, dht, store, list(layers)
        self.machine = machine
        self.check_period, self.stagger, self.expiration = check_period, stagger, expiration
        self.channels, self.metrics, self.max_bytes = channels, metrics, max_bytes
        self.subkey = server_subkey(dht.identity.public_key)
        self.adopted: list[Adoption] = []
        self._empty: dict[str, tuple[float, int]] = {}  # uid -> (monotonic time first seen empty, rank)
        self._taken: set[str] = set()  # served uids the last look found owned by another key
        # served uids this server read itself the owner of: at the last look (_owning), at two looks in a row or
        # by a claim it won (_owned: it holds the uid, and never gives way in a tie, see drop_taken)
        self._owning: set[str] = set()
        self._owned: set[str] = set()
        # served uids that read as nobody's because this server's entry ties with another key's: uid -> (monotonic
        # time first seen, the rival's entry then), see drop_taken
        self._tied: dict[str, tuple[float, Entry]] = {}
        # uid -> the monotonic time before which it is not claimed again: this server lost a claim of it, and its
        # entries of that claim live until then (see :meth:`adopt`)
        self._lost: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        announcer = self.server.announcer
        return announcer.endpoint if announcer is not None and announcer.endpoint else self.server.endpoint

    def held_elsewhere(self) -> dict[str, HeldReplica]:
        """The replicas held of experts this server does not serve itself."""
        return {uid: held for uid, held in self.store.held().items() if uid not in self.server.backends}

    def announce(self) -> None:
        """Stores this server as a host of its layers and as a holder of each replica it holds (not served here)."""
        expires = time.time() + self.expiration
        host = host_value(self.endpoint, self.machine)
        records = {hosts_key(layer): {self.subkey: (host, expires)} for layer in self.layers}
        for uid, held in self.held_elsewhere().items():
            value = Holder(self.endpoint, held.updates, held.signer.hex()[:SIGNER_HEX], b"").value()
            records[replicas_key(uid)] = {self.subkey: (value, expires)}
        results = self.dht.store_many(records)
        failed = [key for key, result in results.items() if result[self.subkey] is not True]
        taken = [key for key in failed if "owned by" in str(results[key][self.subkey])]
        if taken:  # another key stored there first: until it lets go, this server receives and announces nothing
            logger.warning("this server's subkey %d is another key's in %d replica record(s), e.g. %s: %s",
                           self.subkey, len(taken), taken[0], results[taken[0]][self.subkey])
        elif failed:
            logger.info("%d of %d replica records were not stored: %s", len(failed), len(records), failed[:3])

    def rank(self, uid: str, announced: Sequence[Holder]) -> int:
        """How many of the holders of ``uid``'s replica go before this server: more updates, or as many and closer
        to the expert's key. Not knowing the others (the DHT did not answer), it goes first: the claim settles it.

        Announced counts and entries cost nothing, so the holders announcing more are asked for their replica's
        header (signed; all at once, within :data:`PROBE_TIMEOUT`, as :func:`newest_replica` asks them), and only
        those whose header shows a replica of a signer this server trusts (:func:`expected_signers`) that goes
        before its own count, one per machine (:func:`~dmoe.replicas.records.holder_machine`): each announced
        holder counted, answering or not, and 200 throwaway entries at an endpoint nobody answers at made the
        holder of the newest replica wait 200 staggers (400 s) before it adopted (review 105 D6)."""
        if not self.stagger:
            return 0  # (a rank waits nothing then: no holder is asked)
        held = self.store.header(uid)
        me = self.dht.identity.public_key
        mine = (-(held.updates if held is not None else 0), distance(uid, me))
        closest: dict[str, int] = {}  # endpoint -> the distance of the closest key announcing it ahead of this one
        for h in announced:
            if h.holder != me and (-h.updates, distance(uid, h.holder)) < mine:
                closest[h.endpoint] = min(distance(uid, h.holder), closest.get(h.endpoint, distance(uid, h.holder)))
        if not closest:
            return 0
        signers = expected_signers(held, None, me)
        machines = set()
        for endpoint, header in fetch_headers(self.channels, uid, closest, max_bytes=self.max_bytes,
                                              timeout=PROBE_TIMEOUT, stop=self._stop).items():
            if isinstance(header, Exception) or header.signer.hex()[:SIGNER_HEX] not in signers \
                    or not (-header.updates, closest[endpoint]) < mine:
                continue
            machine = holder_machine(endpoint)
            if machine is not None:
                machines.add(machine)
        return len(machines)

    def drop_taken(self) -> list[str]:
        """Stops serving the experts whose uid another key owns in the directory at two looks in a row (one may
        catch a store on its way), and those whose entry ties with another key's that this server gives way to
        (:meth:`_give_way`); returns them. Owning a uid lasts while its declarations do, so this server lost
        it: it was paused or cut off for longer (a laptop asleep), and another server adopted the expert and trains
        it. Served on, the stale copy also took the uid back when that adopter left, and the adopter's training
        was lost. Dropped, the uid is a replica this server may hold like any other, adopted from the newest
        replica when its cell empties (review 59)."""
        served = list(self.server.backends)
        if not served:
            self._taken.clear()
            self._owning.clear()
            self._owned.clear()
            self._tied.clear()
            return []
        me = self.dht.identity.public_key
        ties: dict[str, list[Entry]] = {}
        entries = directory_entries(self.dht, served, ties)
        owning = {uid for uid in served if entries[uid] is not None and entries[uid].owner == me}
        self._owned = (self._owned & set(served)) | (owning & self._owning)
        self._owning = owning
        taken = {uid for uid in served if entries[uid] is not None and entries[uid].owner != me}
        dropped = sorted(taken & self._taken)
        self._taken = taken - set(dropped)
        for uid in dropped:
            self.server.remove_expert(uid)
            logger.warning("%s is another server's now (%s, at %s): this one lost it (paused or cut off for longer "
                           "than its declarations last) and stops serving its stale copy", uid,
                           entries[uid].owner.hex()[:SIGNER_HEX], entries[uid].value)
        return dropped + self._give_way({uid: tied for uid, tied in ties.items() if uid in self.server.backends})

    def _give_way(self, ties: Mapping[str, list[Entry]]) -> list[str]:
        """Stops serving the uids of ``ties`` (uid -> the entries of the keys whose replicas of its directory entry
        tie, as read now) that this server gives way to another key in; returns them.

        Each node keeps the first key that stored a uid's entry, and readers read a tie as nobody's: two servers
        whose first declarations of one cell reached its record's nodes in opposite orders (two ``--num-experts``
        servers choosing one free cell at the same moment) both served it and refreshed their halves for as long
        as both ran, and no client ever found it (review 105 D4). One must stop declaring it, so that its half
        expires and the other's next refresh takes those nodes:

        * a server that owned the uid (read itself its owner at two looks in a row, or won its claim) never gives
          way: a key that reached some of the nodes later (a new node of the record taken first by a hostile key,
          a partition healing) would otherwise take a live server's cell;
        * nor to an entry that was not issued anew since the tie was first seen: a stale one expires by itself;
        * otherwise it gives way to a live rival closer to the uid's key (the rule both sides read alike), and to
          a farther one too once the tie has lasted long enough for that one to have given way and its entries to
          have expired (it owned the uid, or plays by no rule): two ``expiration``.

        Giving way keeps the expert's training: its snapshot goes into this server's own store (unless a newer
        replica is held there), which its checkpoint, if any, keeps too, so this server holds it as a replica,
        announces it, and adopts it back when the cell empties (its rival left), from the newest replica; not
        before its own entries have expired (as after a lost claim, :meth:`adopt`)."""
        me = self.dht.identity.public_key
        now = time.monotonic()
        for uid in set(self._tied) - set(ties):
            del self._tied[uid]  # the tie ended
        given = []
        for uid, tied in ties.items():
            rivals = sorted((entry for entry in tied if entry.owner != me),
                            key=lambda entry: distance(uid, entry.owner))
            if uid in self._owned or not rivals:
                self._tied.pop(uid, None)
                continue
            rival = rivals[0]
            seen = self._tied.get(uid)
            if seen is None or seen[1].owner != rival.owner:
                self._tied[uid] = (now, rival)
                logger.info("%s reads as nobody's: this server's declaration ties with %s's (at %s)", uid,
                            rival.owner.hex()[:SIGNER_HEX], rival.value)
                continue
            since, first = seen
            # (this server's own entry not among the tied ones: it has fewer replicas than both)
            closer = len(rivals) == len(tied) or distance(uid, rival.owner) < distance(uid, me)
            if rival.issued_us > first.issued_us and (closer or now - since >= 2 * self.expiration):
                given.append(uid)
        for uid in given:
            del self._tied[uid]
            self._keep_given(uid)
            self.server.remove_expert(uid)
            self._lost[uid] = time.monotonic() + self.expiration + random.uniform(0.0, self.check_period)
            logger.warning("%s: this server's declaration ties with another key's, and readers find nobody (the two "
                           "reached the record's nodes in opposite orders): this server gives way, holding the "
                           "expert as a replica, and adopts it back if its cell empties", uid)
        return given

    def _keep_given(self, uid: str) -> None:
        """Writes the snapshot of ``uid``, served here, into this server's own store, unless a replica with more
        updates is held there: this server gives it way (:meth:`_give_way`) and keeps its training."""
        backend = self.server.backends[uid]
        held = self.store.header(uid)
        if held is not None and held.updates > backend.updates:
            return
        try:
            self.store.put(sign(take(backend, self.server.runtime.paused), self.dht.identity))
        except (OSError, SnapshotRefused) as error:  # a full disk, a budget too small: its checkpoint, if any, keeps it
            logger.warning("could not keep the snapshot of %s in %s: %s", uid, self.store.directory, error)

    def watch(self) -> list[str]:
        """Looks at the cells of the replicas held; adopts those empty long enough. Returns the uids adopted."""
        held = sorted(self.held_elsewhere())
        if not held:
            self._empty.clear()
            return []
        entries = directory_entries(self.dht, held)
        now = time.monotonic()
        me = self.dht.identity.public_key
        for uid in [uid for uid, until in self._lost.items() if until <= now or uid not in entries]:
            del self._lost[uid]
        # (own: a failed claim; a claim lost lately: not until its entries expired, see adopt)
        empty = [uid for uid in held
                 if uid not in self._lost and (entries[uid] is None or entries[uid].owner == me)]
        for uid in set(self._empty) - set(empty):
            del self._empty[uid]  # served again
        new = [uid for uid in empty if uid not in self._empty]
        announced = read_holders(self.dht, new) if new else {}
        for uid in new:
            self._empty[uid] = (now, self.rank(uid, announced[uid]))
            logger.info("%s is not served by anyone: adopting it in %.1f s unless another holder of its replica "
                        "does", uid, self._empty[uid][1] * self.stagger)
        due = []
        for uid in empty:
            since, rank = self._empty[uid]
            if now >= since + rank * self.stagger:
                due.append(uid)
                self._empty.pop(uid)  # adopted, lost, or failed: looked at again from scratch
        return self.adopt(due) if due and not self._stop.is_set() else []

    def adopt(self, uids: Sequence[str]) -> list[str]:
        """Adopts ``uids`` now, all claimed together (see the module doc); returns those this server serves now."""
        if self.server.backend_factory is None:
            logger.error("cannot adopt %s: this server has no backend factory", ", ".join(uids))
            return []
        me = self.dht.identity.public_key
        entries = directory_entries(self.dht, list(uids))
        uids = [uid for uid in uids if entries[uid] is None or entries[uid].owner == me]  # not served again meanwhile
        announced = read_holders(self.dht, uids)
        ready: dict[str, tuple[SignedSnapshot, object]] = {}
        try:
            for uid in uids:
                if self._stop.is_set():
                    break  # (closing: what is ready is still claimed or let go below)
                found = self._prepare(uid, announced[uid], entries[uid].owner if entries[uid] is not None else None)
                if found is not None:
                    ready[uid] = found
        except BaseException:  # (not an exception of one uid's: those are caught in _prepare)
            for uid in ready:
                self.server.remove_expert(uid)
            raise
        if not ready:
            return []
        if self._stop.is_set():  # (closing: a claim now would declare a uid that this server no longer serves)
            for uid in ready:
                self.server.remove_expert(uid)
            logger.info("stopping: %s not claimed", ", ".join(ready))
            return []
        try:
            stored, won = claim_stored(self.dht, list(ready), self.endpoint, self.expiration)
        except BaseException:
            for uid in ready:
                self.server.remove_expert(uid)
            raise
        # a lost claim's entries live ``expiration`` s where the DHT stored them: claimed again at the next look, they
        # were refreshed, and a claim race that split a uid's replicas evenly (which readers see as nobody's) went
        # on for as long as both claimants ran (review 88). Not claimed again until they expired (and a random part
        # of a look more, so that the claimants come back apart), the uid is empty then, and the ranks order the
        # claims anew.
        again = time.monotonic() + self.expiration + random.uniform(0.0, self.check_period)
        for uid in ready:
            if uid not in won:
                self.server.remove_expert(uid)
                if uid not in stored:
                    logger.info("%s was claimed by another server first: not adopting it", uid)
                    continue
                self._lost[uid] = again
                logger.info("%s was claimed by another server first, or readers find no owner (a tie of claims): "
                            "not adopting it, nor claiming it again for %.1f s, until this server's entries of it "
                            "expired", uid, again - time.monotonic())
        self._owned.update(won)  # (read back twice: owned, see drop_taken)
        if won and self.server.announcer is not None:
            self.server.announcer.add(won)  # keeps them declared from now on
        adoptions = []
        for uid in won:
            signed, snapshot = ready[uid]
            adoptions.append(Adoption(uid, time.time(), snapshot.updates, snapshot.backward_calls))
            logger.info("adopted %s from a replica with %d updates (taken %.1f s ago, sha256 %s)", uid,
                           snapshot.updates, time.time() - snapshot.taken_at, signed.header.sha256.hex()[:16])
        self.adopted.extend(adoptions)
        if self.metrics is not None and won:
            self.metrics.adopted.inc(len(won))
        note_adoptions(self.dht, adoptions)
        return won

    def _prepare(self, uid: str, announced: Sequence[Holder],
                 owner: bytes | None) -> tuple[SignedSnapshot, object] | None:
        """Loads the newest replica of ``uid`` into a new backend and serves it, unclaimed yet; returns (signed,
        snapshot), or None (logged) when that fails. Each uid on its own: an exception no check foresaw (an
        OverflowError from a replica's +inf step count, a ValueError of ``load_state_dict``) used to escape
        :meth:`adopt` with the uids before it served but never claimed nor declared, and the uids after it never
        adopted, again at every look (review 78)."""
        try:
            backend = self.server.backend_factory(uid)
            found = newest_replica(self.dht, uid, backend, self.channels, max_bytes=self.max_bytes, store=self.store,
                                   announced=announced, owner=owner, stop=self._stop)
            if self._stop.is_set():
                return None  # (closing: not claimed, see adopt)
            if found is None:
                logger.warning("no usable replica of %s: not adopting it", uid)
                return None
            signed, snapshot, state = found
            load_into(backend, snapshot, state)
            try:  # served before it is claimed: the first callers the claim sends here find it
                self.server.add_expert(uid, backend, announce=False)
            except (ValueError, RuntimeError) as error:
                logger.warning("could not serve adopted %s: %s", uid, error)
                return None
            return signed, snapshot
        except Exception as error:  # noqa: BLE001 - this uid is not adopted now; the others are
            logger.warning("could not adopt %s: %s: %s", uid, type(error).__name__, error)
            return None

    def start(self) -> "Adopter":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dmoe-replica-adopter", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            for step in (self.drop_taken, self.announce, self.watch):
                if self._stop.is_set():
                    return
                try:
                    step()
                except Exception:  # noqa: BLE001 - a DHT hiccup must not end the watch
                    logger.exception("replica %s failed", step.__name__)
            if self._stop.wait(max(0.0, self.check_period - (time.monotonic() - started))):
                return

    def stop(self) -> None:
        """Tells the thread to stop: the probes and fetches under way are cancelled, nothing more is claimed.
        :meth:`close` waits for it."""
        self._stop.set()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stops the thread and waits for it, ``timeout`` seconds at most (logged when it takes longer: a DHT
        look-up under way; the thread, a daemon, then ends by itself and claims nothing)."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the replica adopter did not stop within %.0f s (a DHT look-up under way?): not "
                               "waiting for it", timeout)
            self._thread = None
